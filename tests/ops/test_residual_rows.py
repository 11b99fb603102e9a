"""A verify step's residual steps in one call (ops.residual_rows): row r bit for bit
ops.residual_step on row r (the residual, the norm, the quantisation, the fp32 product, the
routing), with and without each part, on the calling thread and forked over 1-4 threads (a
child process of 4 Numba threads: the product forks from residual_step.PRODUCT_FORK_THREADS)."""

import json
import subprocess
import sys

import numba
import numpy as np
import pytest

from fermijit.jit import cpu
from fermijit.jit.cpu import configure_threads
from fermijit.ops import matvec, residual_rows, residual_step
from tests.numerics import assert_close, poisoned

EPS = 1e-6
CASES = {  # H, R' (product rows), k (0: no routing), add, rows
    "H64-no-product-2": (64, 0, 0, True, 2),
    "H96-R5-gates-first-layer-2": (96, 5, 0, False, 2),
    "H2080-R37-k3-3": (2080, 37, 3, True, 3),
    "H256-R128-k8-2": (256, 128, 8, True, 2),
    "H256-R20-k4-1": (256, 20, 4, True, 1),
}


def _inputs(rng, R, H, P):
    f = np.float32
    return (rng.standard_normal((R, H)).astype(f), rng.standard_normal((R, H)).astype(f),
            (0.3 * rng.standard_normal(H)).astype(f),
            (rng.standard_normal((P, H)) / np.sqrt(H)).astype(f))


def _both(x, y, nw, w, k, add):
    """(each row through residual_step, all rows through residual_rows): x, xn, act, p, ids,
    weights of each."""
    R, H = x.shape
    isa = matvec.default_isa(1)
    out = []
    for rows in (False, True):
        xs = x.copy()
        xn, p = poisoned((R, H)), poisoned((R, w.shape[0]))
        act = matvec.quantize_act(np.zeros((R, H), np.float32), isa)
        ids, weights = np.full((R, k), -1, np.int32), poisoned((R, k))
        if rows:
            residual_rows.cpu(xs, y if add else None, nw, EPS, xn, act, w, p, ids, weights)
        else:
            for r in range(R):
                one = matvec.Q8Act(act.xq[r:r + 1], act.dx[r:r + 1], act.xsum8[r:r + 1],
                                   act.vec)
                residual_step.cpu(xs[r:r + 1], y[r:r + 1] if add else None, nw, EPS,
                                  xn[r:r + 1], one, w, p[r:r + 1], ids[r:r + 1],
                                  weights[r:r + 1])
        out.append((xs, xn, act.xq, act.dx, act.xsum8, p, ids, weights))
    return out


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_rows_are_residual_step_row_by_row(rng, case):
    H, P, k, add, R = case
    x, y, nw, w = _inputs(rng, R, H, P)
    before = numba.get_num_threads()
    try:
        for n in range(1, min(2, numba.config.NUMBA_NUM_THREADS) + 1):
            configure_threads(n)
            one, rows = _both(x, y, nw, w, k, add)
            for name, a, b in zip(("x", "xn", "xq", "dx", "xsum8", "p", "ids", "weights"),
                                  one, rows):
                assert np.array_equal(a, b), f"{name} at {n} threads"
    finally:
        configure_threads(before)
    ref_x, ref_xn, ref_p = residual_rows.reference(x, y if add else None, nw, EPS, w, k)
    assert_close("xn", ref_xn, rows[1], 1e-5 * np.abs(ref_xn).max(), 1e-5)
    if k:
        np.testing.assert_array_equal(ref_p[0], rows[6])
    elif P:
        assert_close("p", ref_p, rows[5], 1e-5 * np.abs(ref_p).max(), 1e-5)


FORKED = """
import json, sys
import numpy as np
from fermijit.jit.cpu import configure_threads
from tests.ops.test_residual_rows import _both, _inputs
rng = np.random.default_rng(int(sys.argv[1]))
same = []
for n in (3, 4):
    configure_threads(n)
    for H, P, k, add, R in ((2080, 37, 3, True, 2), (256, 128, 8, True, 3), (96, 5, 0, False, 2)):
        x, y, nw, w = _inputs(rng, R, H, P)
        one, rows = _both(x, y, nw, w, k, add)
        same.append(all(np.array_equal(a, b) for a, b in zip(one, rows)))
print(json.dumps(same))
"""


def test_forked_product_rows_are_residual_step_row_by_row(rng):
    """At 3 and 4 threads the product forks (residual_step's over its rows, residual_rows' over
    its rows for every input row): a child process with 4 Numba threads."""
    env = dict(cpu.child_env(), NUMBA_NUM_THREADS="4")
    seed = int(rng.integers(1 << 30))
    done = subprocess.run([sys.executable, "-c", FORKED, str(seed)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    same = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(same) == 6 and all(same)
