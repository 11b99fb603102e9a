"""fermijit.jit.omp: one OpenMP fork per launch."""

import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest

from fermijit.jit import omp
from fermijit.jit.cpu import kernel


def _record(thread, n_threads, args):
    (seen,) = args
    seen[thread] = n_threads


def _launch(seen):
    fork((seen,))


record_threads = kernel(_launch, fork=omp.fork(_record),
                        variant="omp" if omp.available() else "serial")


@pytest.mark.skipif(not omp.available(), reason="Numba's threading layer is not omp here")
def test_each_thread_of_the_team_runs_its_share_once():
    full = numba.get_num_threads()
    try:
        for n in sorted({1, full}):
            numba.set_num_threads(n)
            seen = np.full(numba.config.NUMBA_NUM_THREADS + 1, -1)
            record_threads(seen)
            assert seen[:n].tolist() == [n] * n     # thread t of n wrote n, once
            assert (seen[n:] == -1).all()          # no thread beyond the team
    finally:
        numba.set_num_threads(full)


CACHED = textwrap.dedent("""
    import numba
    import numpy as np
    from fermijit.jit import omp
    from fermijit.jit.cpu import kernel

    def _share(thread, n_threads, args):
        (out,) = args
        out[thread] = thread + 1

    def _launch(out):
        fork((out,))

    f = kernel(_launch, fork=omp.fork(_share), variant=str(omp.available()))
    out = np.zeros(numba.config.NUMBA_NUM_THREADS, np.int64)
    f(out)
    n = numba.get_num_threads() if omp.available() else 1
    print(int(out.sum()) == n * (n + 1) // 2, sum(f.stats.cache_hits.values()))
""")


def test_a_forking_kernel_loads_from_the_cache(tmp_path):
    """The cached object calls libgomp: a fresh process must link it (not crash, not miss)."""
    (tmp_path / "forker.py").write_text(CACHED)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), *sys.path]))

    def run():
        r = subprocess.run([sys.executable, str(tmp_path / "forker.py")], env=env,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return tuple(r.stdout.split())

    assert run() == ("True", "0")   # every thread ran its share; compiled
    assert run() == ("True", "1")   # the same, loaded from the cache


WITHOUT_OMP = textwrap.dedent("""
    import numpy as np
    from fermijit.jit import omp
    from fermijit.ops import matvec, quant
    rng = np.random.default_rng(3)
    qs, d = quant.quantize_q4_0(rng.standard_normal((37, 96)).astype(np.float32))
    x = rng.standard_normal(96).astype(np.float32)
    y, ref = matvec.cpu(qs, d, x), matvec.reference(qs, d, x)
    print(omp.available(), float(np.abs(y - ref).max() / np.abs(ref).max()))
""")


def test_without_the_omp_layer_products_run_as_a_team_of_one(tmp_path):
    """Where Numba's threading layer is not omp, `fork` must not call libgomp (a second pool of
    threads): the products still run, correctly, on the calling thread."""
    env = dict(os.environ, NUMBA_THREADING_LAYER="workqueue", NUMBA_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", WITHOUT_OMP], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    available, err = r.stdout.split()
    assert available == "False" and float(err) < 1e-5
