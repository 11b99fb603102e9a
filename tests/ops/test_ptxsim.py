"""flash_attention.ptx, gdn_chunk.ptx and kquant_gemm.ptx run by tests/ptxsim.py (a PTX
interpreter) against the numpy references, so their index arithmetic is checked without a GPU:
one block of each on a ragged shape (the GPU tests take every block)."""

from pathlib import Path

import numpy as np
import pytest

from fermijit.jit import ptx
from fermijit.ops import attention, gated_delta, kquant_gemm
from tests.numerics import assert_close
from tests.ops.test_gated_delta import make_inputs
from tests.ops.test_kquant_gemm_gpu import GEMM_REL, random_weights
from tests.ptxsim import GMem, Kernel, Sim

TEMPLATES = Path(__file__).resolve().parents[2] / "kernels_ptx"


def rendered(name: str, **params) -> str:
    source = (TEMPLATES / f"{name}.ptx").read_text()
    return ptx.render_source(name, source, ptx.declared_params(name), params).text


@pytest.mark.slow
def test_flash_attention_block(rng):
    """The block of the last 8 queries (blocks run longest first: block 0), 4 heads of a GQA
    group, 2 key tiles: rows past the last query computed, never stored."""
    T, Hq, Hkv, D, start = 70, 8, 2, 64, 0
    q = rng.standard_normal((T, Hq, D)).astype(np.float32)
    k = rng.standard_normal((Hkv, T, D)).astype(np.float32)
    v = rng.standard_normal((Hkv, T, D)).astype(np.float32)
    gate = (2 * rng.standard_normal((T, Hq, D))).astype(np.float32)
    mem = GMem()
    addrs = [mem.put(a) for a in (q, k, v, gate, np.full((T, Hq, D), np.nan, np.float32))]
    heap = mem.build()
    group_heads = 4                                       # G = 4: 8 queries a block
    grid = (-(-T // 8), Hkv)
    params = [*addrs, T, Hq, Hkv, T, start, float(np.float32(1 / np.sqrt(D))), group_heads]
    Sim(Kernel(rendered("flash_attention", HEAD_DIM=D), "flash_attention_64"),
        {"__param__": params}, heap, grid, 256).run_block(0, 1)
    out = mem.get(addrs[4], (T, Hq, D))
    expected = attention.reference(q, k, v, gate, start)
    rows = (slice(64, 70), slice(4, 8))                   # queries 64..69, kv head 1's heads
    assert not np.isnan(out[rows]).any()
    assert_close("o", expected[rows], out[rows], 1e-6, 1e-4)
    out[rows] = np.nan
    assert np.isnan(out).all()                            # and nothing else written


@pytest.mark.slow
def test_gdn_chunk_blocks(rng):
    """gdn_chunk_prep's blocks, then one gdn_chunk_scan block over 2 ragged chunks (dk = 64:
    the scan's skipped halves): its 32 columns of o and of the state."""
    T, Hk, Hv, dk, dv = 70, 1, 1, 64, 64
    q, k, v, g, beta, state = make_inputs(rng, T, Hk, Hv, dk, dv)
    expected_o, expected_state = gated_delta.reference(q, k, v, g, beta, state.copy())
    n = -(-T // 64)
    mem = GMem()
    aq, ak, av, ag, abeta = (mem.put(a) for a in (q, k, v, g, beta))
    scratch = [mem.put(np.full(shape, np.nan, np.float32))
               for shape in ((Hv, n, 64), (Hv, n, 64, 64), (Hv, n, 64, 64))]
    astate, aout = mem.put(state), mem.put(np.full((T, Hv, dv), np.nan, np.float32))
    heap = mem.build()
    text = rendered("gdn_chunk")
    prep = Sim(Kernel(text, "gdn_chunk_prep"),
               {"__param__": [aq, ak, ag, abeta, *scratch, T, Hk, Hv, dk]}, heap, (n, Hv), 256)
    for chunk in range(n):
        prep.run_block(chunk, 0)
    Sim(Kernel(text, "gdn_chunk_scan"),
        {"__param__": [aq, ak, av, *scratch, astate, aout, T, Hk, Hv, dk, dv]}, heap,
        (dv // 32, Hv), 256).run_block(1, 0)
    cols = slice(32, 64)
    o, new_state = mem.get(aout, (T, Hv, dv)), mem.get(astate, (Hv, dk, dv))
    assert_close("o", expected_o[..., cols], o[..., cols], 1e-5, 1e-4)
    assert_close("state", expected_state[..., cols], new_state[..., cols], 1e-5, 1e-4)
    assert np.isnan(o[..., :32]).all()
    np.testing.assert_array_equal(new_state[..., :32], state[..., :32])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["q5_k", "q4_k"])
def test_kquant_gemm_dense_block(rng, kind):
    """One dense block (64 rows, 128 columns) on T 21, N 70, K 512 (both tiles partial, two
    super-blocks): rows 0-4 random, within the GPU test's GEMM_REL of the float64 reference;
    rows 5-20 one-hot, one in each of the 16 sub-blocks at a random offset, so each output is one
    weight: equal to ops/kquant.py's dequantize bit for bit. The rows past T stay NaN. (Q4_K,
    whose kernel the H200 has passed, checks the interpreter on the same path.)"""
    T, N, K, n_random = 21, 70, 512, 5
    x = np.zeros((T, K), np.float32)
    x[:n_random] = rng.standard_normal((n_random, K))
    cols = 32 * np.arange(T - n_random) + rng.integers(0, 32, T - n_random)
    x[np.arange(n_random, T), cols] = 1
    blocks = random_weights(rng, kind, (N,), K)
    mem = GMem()
    ax, aw = mem.put(x), mem.put(blocks)
    aout = mem.put(np.full((T + 2, N), np.nan, np.float32))
    heap = mem.build()
    Sim(Kernel(rendered("kquant_gemm", MODE="dense", FORMAT=kind), f"kquant_gemm_{kind}_dense"),
        {"__param__": [ax, aw, 0, aout, 0, 0, 0, T, N, K]}, heap, (1, 1), 256).run_block(0, 0)
    out = mem.get(aout, (T + 2, N))
    expected = kquant_gemm.reference(kind, x[:n_random], blocks)
    scale = float(np.abs(expected).max())
    err = float(np.abs(out[:n_random] - expected).max())
    print(f"kquant_gemm {kind} ptxsim: max |error| {err:.3g}, {err / scale:.3g} of the largest")
    assert_close("y", expected, out[:n_random], GEMM_REL * scale, GEMM_REL)
    weights = kquant_gemm.dequantize(kind, blocks)[:, cols].T + np.float32(0)  # -0.0 -> +0.0
    np.testing.assert_array_equal(out[n_random:T].view(np.uint32),
                                  np.ascontiguousarray(weights).view(np.uint32))
    assert np.isnan(out[T:]).all()
