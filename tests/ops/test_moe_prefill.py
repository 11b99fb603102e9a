"""The MoE prefill's buffers (moe.Scratch.prefill): one scratch reused across passes and across
layers of other shapes (pruned models) gives each call its own exact result."""

import numpy as np

from fermijit.ops import moe
from tests.numerics import assert_close, poisoned
from tests.ops.test_moe import RTOL, _routing, _w4a8_reference, _weights


def test_scratch_reused_across_shapes_and_pass_sizes(rng):
    """Layers of 8 then 12 experts (offsets of another size), other intermediate sizes, and pass
    sizes 9 then 5 then 9 again, all through one scratch: each call as if alone."""
    w_a = _weights(rng, 8, 64, 32, 32)
    w_b = _weights(rng, 12, 64, 64, 96)
    scratch = moe.Scratch.make(w_a, 2)
    for w, n_tok in ((w_a, 9), (w_b, 9), (w_a, 9), (w_b, 5), (w_a, 9)):
        n_experts = w.gate_up_qs.shape[0]
        x = rng.standard_normal((n_tok, 64)).astype(np.float32)
        ids, weights = _routing(rng, n_tok, n_experts, 2)
        out = moe.cpu(x, ids, weights, w, out=poisoned(x.shape), scratch=scratch)
        assert scratch.prefill is not None and scratch.prefill.fits(w, n_tok, 2)
        expected = _w4a8_reference(x, ids, weights, w)
        assert_close("moe prefill", expected, out, atol=RTOL * np.abs(expected).max(), rtol=RTOL)
