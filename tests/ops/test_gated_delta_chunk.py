"""The chunked gated delta rule on the CPU (ops.gated_delta_chunk.cpu) against the recurrence's
float64 reference and the composition of the chunk stages' references."""

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.ops import gated_delta
from fermijit.ops import gated_delta_chunk as chunk
from tests.numerics import assert_close, poisoned
from tests.ops.test_gated_delta import make_inputs

# fp32 chunked form vs the float64 recurrence: the same sums in another order plus the 64x64
# triangular solve. Measured max abs error 1.0e-6 on the state (|state| <= 3) and 6e-7 on o
# (shapes below); 10x margin.
ATOL, RTOL = 1e-5, 1e-4

# (T, Hk, Hv, dk, dv): ragged T (a partial last chunk, exactly one chunk, one over), grouped and
# ungrouped heads, ragged head dims, and the real head shape.
SHAPES = {
    "T1-Hk2-Hv4-dk16-dv8": (1, 2, 4, 16, 8),
    "T63-Hk2-Hv4-dk60-dv100": (63, 2, 4, 60, 100),
    "T64-Hk1-Hv2-dk32-dv32": (64, 1, 2, 32, 32),
    "T65-Hk3-Hv3-dk32-dv48": (65, 3, 3, 32, 48),
    "T150-Hk1-Hv8-dk16-dv24": (150, 1, 8, 16, 24),
    "T70-Hk2-Hv4-D128": (70, 2, 4, 128, 128),
}


def _f64(xs):
    return [x.astype(np.float64) for x in xs]


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_cpu_matches_recurrence(rng, shape):
    q, k, v, g, beta, state = make_inputs(rng, *shape)
    o_ref, state_ref = gated_delta.reference(*_f64([q, k, v, g, beta, state]))
    out = poisoned(v.shape)
    o, new_state = chunk.cpu(q, k, v, g, beta, state, out=out)
    assert o is out and new_state is state
    assert_close("o", o_ref, o, ATOL, RTOL)
    assert_close("state", state_ref, state, ATOL, RTOL)


def test_cpu_matches_stage_references(rng):
    """The stages' numpy references composed (gated_delta.chunked_reference) in float64."""
    q, k, v, g, beta, state = make_inputs(rng, 100, 2, 4, 32, 40)
    o_ref, state_ref = gated_delta.chunked_reference(*_f64([q, k, v, g, beta, state]),
                                                     chunk=chunk.CHUNK)
    o, _ = chunk.cpu(q, k, v, g, beta, state, out=poisoned(v.shape))
    assert_close("o", o_ref, o, ATOL, RTOL)
    assert_close("state", state_ref, state, ATOL, RTOL)


def test_state_carries_across_calls(rng):
    """Prompts in pieces that do not end on chunk boundaries, then a decode step of the
    recurrence: the same as one pass over all the tokens."""
    q, k, v, g, beta, state = make_inputs(rng, 132, 2, 4, 32, 24)
    o_ref, state_ref = gated_delta.reference(*_f64([q, k, v, g, beta, state]))
    o = poisoned(v.shape)
    for a, b in ((0, 50), (50, 131)):
        part = slice(a, b)
        chunk.cpu(q[part], k[part], v[part], g[part], beta[part], state, out=o[part])
    last = slice(131, 132)
    gated_delta.cpu(q[last], k[last], v[last], g[last], beta[last], state, out=o[last])
    assert_close("o", o_ref, o, ATOL, RTOL)
    assert_close("state", state_ref, state, ATOL, RTOL)


def test_bad_inputs(rng):
    q, k, v, g, beta, state = make_inputs(rng, 5, 2, 3, 8, 8)
    with pytest.raises(FermijitError, match="not a multiple"):
        chunk.cpu(q, k, v, g, beta, state)
    q, k, v, g, beta, state = make_inputs(rng, 5, 2, 4, 8, 8)
    with pytest.raises(FermijitError, match="state has shape"):
        chunk.cpu(q, k, v, g, beta, state[:3])
    with pytest.raises(FermijitError, match="dtype"):
        chunk.cpu(q.astype(np.float64), k, v, g, beta, state)
    frozen = state.copy()
    frozen.flags.writeable = False
    with pytest.raises(FermijitError, match="read-only"):
        chunk.cpu(q, k, v, g, beta, frozen)
    with pytest.raises(FermijitError, match="out"):
        chunk.cpu(q, k, v, g, beta, state, out=poisoned((5, 4, 9)))
