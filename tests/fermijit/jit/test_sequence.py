"""jit/sequence.py: kernels joined into one dispatch give their own calls' bits, in order; what
cannot be joined stays a call of its own."""

import numba
import numpy as np
import pytest

from fermijit.jit import cpu, sequence
from fermijit.jit.cpu import configure_threads, kernel
from fermijit.ops import matvec, quant
from tests.numerics import poisoned

ISAS = cpu.variants_up_to(cpu.selected_isa())


@kernel
def _scale_add(x, a, out):
    for i in range(out.size):
        out[i] = x[i] * a + 1.0


@kernel
def _sum_into(x, out):  # reads what the step before wrote: the order matters
    s = 0.0
    for i in range(x.size):
        s += x[i]
    out[0] = s


@kernel
def _sum_pair(pair):
    x, (out, _) = pair
    _sum_into(x, out)


@kernel
def _returns(x):
    return x.sum()


def test_joined_steps_are_the_calls_in_order(rng):
    n = 37  # ragged
    x = rng.standard_normal(n).astype(np.float32)
    mid, total = poisoned(n), poisoned(1)
    # nested tuples of arrays and numbers, as the ops' launches take them
    steps = [("scale", _scale_add, (x, np.float32(2.5), mid)),
             ("sum", _sum_pair, ((mid, (total, 3)),))]
    want_mid, want_total = poisoned(n), poisoned(1)
    _scale_add(x, np.float32(2.5), want_mid)
    _sum_into(want_mid, want_total)
    joined = sequence.join(steps)
    assert [label for label, _, _ in joined] == ["scale + sum"]
    label, fn, args = joined[0]
    fn(*args)
    np.testing.assert_array_equal(mid, want_mid)
    np.testing.assert_array_equal(total, want_total)


def test_what_cannot_be_joined_stays_apart(rng):
    x = rng.standard_normal(8).astype(np.float32)
    out = poisoned(8)
    python_step = ("python", np.copyto, (out, x))
    returning = ("returns", _returns, (x,))
    kernel_step = ("scale", _scale_add, (x, np.float32(1), out))
    lone = sequence.join([kernel_step, python_step, returning, kernel_step, kernel_step,
                          sequence.BREAK, kernel_step, kernel_step])
    assert [label for label, _, _ in lone] == ["scale", "python", "returns", "scale + scale",
                                               "scale + scale"]
    assert lone[0] is kernel_step and lone[1] is python_step and lone[2] is returning
    assert sequence.callable_address(_returns, (x,)) is None
    assert sequence.callable_address(np.copyto, (out, x)) is None
    # arguments no code can take (typing fails): not joined, the call itself will raise
    assert sequence.callable_address(_sum_into, (x, "not an array")) is None


@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
def test_joined_gemvs_are_their_launches(rng, isa):
    """Forking kernels (the decode GEMV, read-only weights: code declared for read-only arrays
    given writable ones) joined: each output bit for bit its own launch's, at 1 and 2 threads,
    ragged rows."""
    before = numba.get_num_threads()
    try:
        for n_threads in sorted({1, min(2, numba.config.NUMBA_NUM_THREADS)}):
            configure_threads(n_threads)
            steps, outs, want = [], [], []
            x = rng.standard_normal((1, 96)).astype(np.float32)
            act = matvec.quantize_act(x, isa)
            for rows in (5, 33, 12):
                qs, d = quant.quantize_q4_0(rng.standard_normal((rows, 96)).astype(np.float32))
                w = matvec.Q4Matrix.of(qs, d)
                outs.append(poisoned((1, rows)))
                steps.append(("gemv", *matvec.launch(w, act, outs[-1])))
                want.append(poisoned((1, rows)))
                kernel_, args = matvec.launch(w, act, want[-1])
                kernel_(*args)
            joined = sequence.join(steps)
            assert len(joined) == 1
            _, fn, args = joined[0]
            fn(*args)
            for got, expected in zip(outs, want):
                np.testing.assert_array_equal(got, expected)
                assert not np.isnan(got).any()
    finally:
        configure_threads(before)
