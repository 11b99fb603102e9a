"""Prefill's activation quantisation (ops.quantize_rows, matvec.quantize_act for T > 1): bit for
bit decode's kernel on each row alone and the reference's rounding, in every ISA's layout."""

import numba
import numpy as np
import pytest

from fermijit.jit import cpu
from fermijit.ops import gemm, matvec

ISAS = cpu.variants_up_to(cpu.selected_isa())
# (T, K): K of 1 and 3 blocks, 12 (AVX-512's half-width step and SSE's), 29 (wide steps, a
# half-width step and a natural-order tail), 64 (whole wide steps only); T from 2.
SHAPES = {"T2-K32": (2, 32), "T3-K96": (3, 96), "T17-K384": (17, 384), "T5-K928": (5, 928),
          "T9-K2048": (9, 2048)}


def _inputs(rng, n_tok, k):
    """Normal rows, with a zero block, a block of huge and one of tiny values, exact halves
    (x·inv landing on .5: the rounding direction) and a negative zero."""
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    x[0, :32] = 0
    x[0, 0] = -0.0
    x[-1, -32:] *= 1e30
    x[-1, :32] *= 1e-30
    if n_tok > 2:
        x[1, :32] = np.arange(32, dtype=np.float32) - 15.5   # amax 16.5: steps of 127/16.5
        x[1, 7] = 16.5 * 0.5 / 127                           # exactly half a step
    return x


def _poisoned_act(n_tok, k, isa):
    act = matvec.quantize_act(np.zeros((n_tok, k), np.float32), isa)
    act.xq.fill(-77)
    act.dx.fill(np.nan)
    act.xsum8.fill(-12345)
    return act


@pytest.mark.parametrize("isa", ISAS, ids=[i.label for i in ISAS])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_equals_decode_kernel_row_by_row_and_reference(rng, isa, shape):
    n_tok, k = shape
    x = _inputs(rng, n_tok, k)
    act = matvec.quantize_act(x, isa, out=_poisoned_act(n_tok, k, isa))
    for t in range(n_tok):                                     # T = 1: decode's kernel
        one = matvec.quantize_act(x[t:t + 1], isa)
        np.testing.assert_array_equal(act.xq[t], one.xq[0])
        np.testing.assert_array_equal(act.dx[t], one.dx[0])
        np.testing.assert_array_equal(act.xsum8[t], one.xsum8[0])
    natural, dx = matvec.quantize_act_reference(x)            # [T, nb, 32], [T, nb]
    offs = gemm.x_offsets(isa, k // 32)
    got = np.stack([np.concatenate([act.xq[:, lo:lo + 16], act.xq[:, hi:hi + 16]], axis=1)
                    for lo, hi in offs], axis=1)
    np.testing.assert_array_equal(got, natural)
    np.testing.assert_array_equal(act.dx, dx)
    np.testing.assert_array_equal(act.xsum8, 8 * natural.astype(np.int32).sum(axis=-1))


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="one CPU: nothing to compare")
def test_same_bits_for_any_thread_count(rng):
    x = _inputs(rng, 33, 384)
    before = numba.get_num_threads()
    try:
        acts = []
        for n in (1, 2):
            numba.set_num_threads(n)
            acts.append(matvec.quantize_act(x))
    finally:
        numba.set_num_threads(before)
    for name in ("xq", "dx", "xsum8"):
        np.testing.assert_array_equal(getattr(acts[0], name), getattr(acts[1], name))
