"""vision_attention.cpu against the float64 reference, and the 2-D rotary against transformers'
(apply_rotary_pos_emb_vision) where it is installed."""

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.model.vision import rotary_tables
from fermijit.ops import vision_attention
from tests import hf
from tests.numerics import assert_close

# fp32 products over d = 72 and N keys against fp64: ~1e-6 of the outputs (|o| ~ 1).
ATOL, RTOL = 2e-5, 1e-5
CASES = {"tiny": ((1, 4, 6), 2, 16), "real-head": ((1, 6, 10), 2, 72),
         "one-block": ((1, 2, 2), 1, 8)}


def inputs(rng, grid, heads, d):
    n = grid[1] * grid[2]
    qkv = rng.standard_normal((n, 3 * heads * d), dtype=np.float32)
    cos, sin = rotary_tables(grid, 2, d, 10000.0)
    return qkv, cos, sin


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_vision_attention(rng, case, monkeypatch):
    grid, heads, d = case
    qkv, cos, sin = inputs(rng, grid, heads, d)
    want = vision_attention.reference(qkv, cos, sin, heads)
    assert_close("attention", want, vision_attention.cpu(qkv, cos, sin, heads), ATOL, RTOL)
    monkeypatch.setattr(vision_attention, "MAX_SCORES", 3 * qkv.shape[0])  # blocks of 3 queries
    assert_close("in query blocks", want, vision_attention.cpu(qkv, cos, sin, heads), ATOL, RTOL)


def test_bad_width_is_an_error(rng):
    qkv, cos, sin = inputs(rng, (1, 2, 2), 2, 8)
    with pytest.raises(FermijitError, match="not 3 x 3 heads"):
        vision_attention.cpu(qkv, cos, sin, 3)


def test_rotary_equals_transformers(rng):
    modeling = hf.qwen_modeling()
    import torch

    grid, heads, d = (1, 6, 10), 2, 72
    qkv, cos, sin = inputs(rng, grid, heads, d)
    config = modeling.Qwen3_5MoeVisionConfig(hidden_size=heads * d, num_heads=heads)
    rotary = modeling.Qwen3_5MoeVisionRotaryEmbedding(config)
    from fermijit.model.vision import position_grid

    rows, cols = position_grid(grid, 2)
    tcos, tsin = rotary(torch.zeros(1), torch.tensor(np.stack([rows, cols], axis=1)))
    assert_close("cos", tcos.numpy(), cos, 1e-5, 0)  # torch takes the angles in fp32
    assert_close("sin", tsin.numpy(), sin, 1e-5, 0)
