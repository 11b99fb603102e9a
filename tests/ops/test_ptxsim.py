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
@pytest.mark.parametrize("T,dk,dv,block", [(70, 64, 48, 1), (130, 128, 48, 2)],
                         ids=["T70-dk64", "T130-dk128-last"])
def test_gdn_chunk_blocks(rng, T, dk, dv, block):
    """gdn_chunk_prep's blocks, then one gdn_chunk_scan block (16 value columns, its halves each
    summing half of every product's terms) over ragged chunks: its columns of o and of the
    state; the rest of o stays NaN, the rest of the state as it was. dk = 64: the scan's skipped
    halves; dk = 128 over 3 chunks, the last block: the tiles fetched a stage ahead across
    chunks (one case: each takes 20-40 s in the interpreter)."""
    Hk, Hv, width = 1, 2, gated_delta.GPU_VALUE_BLOCK
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
    head = 1
    prep = Sim(Kernel(text, "gdn_chunk_prep"),
               {"__param__": [aq, ak, ag, abeta, *scratch, T, Hk, Hv, dk]}, heap, (n, Hv), 256)
    for chunk in range(n):
        prep.run_block(chunk, head)
    Sim(Kernel(text, "gdn_chunk_scan"),
        {"__param__": [aq, ak, av, *scratch, astate, aout, T, Hk, Hv, dk, dv]}, heap,
        (dv // width, Hv), 256).run_block(block, head)
    cols = slice(block * width, (block + 1) * width)
    o, new_state = mem.get(aout, (T, Hv, dv)), mem.get(astate, (Hv, dk, dv))
    assert not np.isnan(o[:, head, cols]).any()
    assert_close("o", expected_o[:, head, cols], o[:, head, cols], 1e-5, 1e-4)
    assert_close("state", expected_state[head, :, cols], new_state[head, :, cols], 1e-5, 1e-4)
    err_o = np.abs(o[:, head, cols] - expected_o[:, head, cols]).max()
    err_s = np.abs(new_state[head, :, cols] - expected_state[head, :, cols]).max()
    print(f"gdn scan ptxsim T{T} dk{dk}: max rel err o "
          f"{err_o / np.abs(expected_o[:, head, cols]).max():.3g}, state "
          f"{err_s / np.abs(expected_state[head, :, cols]).max():.3g}")
    o[:, head, cols] = np.nan
    assert np.isnan(o).all()
    new_state[head, :, cols] = state[head, :, cols]
    np.testing.assert_array_equal(new_state, state)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["q5_k"])  # and any FORMAT; q4_k passed too (~1 min each)
def test_kquant_gemm_dense_block(rng, kind):
    """One dense block (64 rows, 128 columns) on T 21, N 70, K 512 (both tiles partial, two
    super-blocks): rows 0-4 random, within the GPU test's GEMM_REL of the float64 reference;
    rows 5-20 one-hot, one in each of the 16 sub-blocks at a random offset, so each output is one
    weight: equal to ops/kquant.py's dequantize bit for bit. The rows past T stay NaN."""
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


@pytest.mark.slow
def test_kquant_gemm_q5_k_expert_blocks(rng):
    """The expert modes, one block each, on expert 1's tile of T 7, top-2 of 3 experts, H = I =
    256 (q4_gemm's routing, ops/expert_matmul.sort_slots): gate_up's gathered rows and SwiGLU
    (columns 0-63 of h; the other slots' rows stay NaN), down's weighted scatter-add into y
    (columns 0-127 of the tile's tokens; the rest of y as it was)."""
    from fermijit.ops.expert_matmul import sort_slots

    T, H, I, E, top_k, tile = 7, 256, 256, 3, 2, 1
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :top_k].astype(np.int32)
    weights = rng.random((T, top_k)).astype(np.float32)
    order, _, tiles = sort_slots(ids, E)
    rows = (order // top_k).astype(np.int32)
    slot_weights = weights.reshape(-1)[order]
    e, first, end, _ = tiles[tile]
    x = rng.standard_normal((T, H)).astype(np.float32)
    h_in = rng.standard_normal((T * top_k, I)).astype(np.float32)
    base = rng.standard_normal((T, H)).astype(np.float32)
    gate_up = random_weights(rng, "q5_k", (E, 2 * I), H, 0.03 / np.sqrt(H))
    down = random_weights(rng, "q5_k", (E, H), I, 0.03 / np.sqrt(I))
    mem = GMem()
    ax, agu, adn, ah_in = (mem.put(a) for a in (x, gate_up, down, h_in))
    ah = mem.put(np.full((T * top_k, I), np.nan, np.float32))
    ay, atiles, arows, aw = (mem.put(a) for a in (base, tiles, rows, slot_weights))
    heap = mem.build()
    text = rendered("kquant_gemm", MODE="expert_gate_up", FORMAT="q5_k")
    Sim(Kernel(text, "kquant_gemm_q5_k_expert_gate_up"),
        {"__param__": [ax, agu, 0, ah, atiles, arows, 0, 0, I, H]}, heap,
        (I // 64, len(tiles)), 256).run_block(0, tile)
    text = rendered("kquant_gemm", MODE="expert_down", FORMAT="q5_k")
    Sim(Kernel(text, "kquant_gemm_q5_k_expert_down"),
        {"__param__": [ah_in, adn, 0, ay, atiles, arows, aw, 0, H, I]}, heap,
        (H // 128, len(tiles)), 256).run_block(0, tile)
    w_gu = kquant_gemm.dequantize("q5_k", gate_up[e]).astype(np.float64)
    gu = x[rows[first:end]].astype(np.float64) @ w_gu.T
    g, u = gu[:, :64], gu[:, I:I + 64]
    expected_h = g / (1 + np.exp(-g)) * u
    w_dn = kquant_gemm.dequantize("q5_k", down[e]).astype(np.float64)
    expected_y = base.astype(np.float64)
    expected_y[rows[first:end], :128] += slot_weights[first:end, None] * (
        h_in[first:end].astype(np.float64) @ w_dn[:128].T)        # a token once an expert
    h, y = mem.get(ah, (T * top_k, I)), mem.get(ay, (T, H))
    for name, expected, got in (("h", expected_h, h[first:end, :64]), ("y", expected_y, y)):
        scale = float(np.abs(expected).max())
        print(f"kquant_gemm q5_k expert ptxsim {name}: max |error| "
              f"{np.abs(got - expected).max() / scale:.3g} of the largest")
        assert_close(name, expected, got, GEMM_REL * scale, GEMM_REL)
    h[first:end, :64] = np.nan
    assert np.isnan(h).all()
    touched = np.zeros((T, H), bool)
    touched[rows[first:end], :128] = True
    np.testing.assert_array_equal(y[~touched], base[~touched])
