"""flash_attention.ptx and gdn_chunk.ptx run by tests/ptxsim.py (a PTX interpreter) against the
numpy references, so their index arithmetic is checked without a GPU: one block of each on a
ragged shape (the GPU tests take every block)."""

from pathlib import Path

import numpy as np
import pytest

from fermijit.jit import ptx
from fermijit.ops import attention, gated_delta
from tests.numerics import assert_close
from tests.ops.test_gated_delta import make_inputs
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
