"""The vision tower's GPU kernels (layer_norm.ptx, bias_act.ptx, vision_attn.ptx) against their
references, and the whole GPU tower (model/vision_gpu.py) against the CPU one."""

import dataclasses

import numpy as np
import pytest

from fermijit.model.vision import rotary_tables
from fermijit.ops import bias_act, layer_norm, vision_attention
from tests import gpu
from tests.gpu import report_error
from tests.numerics import assert_close, poisoned

pytestmark = gpu.MARKS

# fp32 sums over the row (D <= 4608) against fp64: ~1e-6 relative.
NORM_ATOL, NORM_RTOL = 1e-5, 1e-5
# ex2.approx (2 ulp) in the GELUs, A-S 7.1.26 erf (1.5e-7 absolute): ~1e-6 of |v|.
ACT_ATOL, ACT_RTOL = 2e-6, 1e-5
# fp32 GEMMs over d and N (<= 1024 here) and ex2.approx in the softmax.
ATTN_ATOL, ATTN_RTOL = 5e-5, 1e-4
# The whole tower, GPU against CPU (both fp32, summed in other orders): the 1e-4 bound.
TOWER_REL = 1e-4


@pytest.mark.parametrize("shape", [(1, 1152), (37, 33), (300, 4608)], ids=str)
def test_layer_norm_gpu(rng, shape):
    x = (3 + 2 * rng.standard_normal(shape)).astype(np.float32)
    w = (1 + 0.3 * rng.standard_normal(shape[-1])).astype(np.float32)
    b = (0.3 * rng.standard_normal(shape[-1])).astype(np.float32)
    out = poisoned(shape)
    layer_norm.gpu(x, w, b, 1e-6, out=out)
    want = layer_norm.reference(x, w, b, 1e-6)
    report_error("layer_norm", want, out)
    assert_close("layer_norm", want, out, NORM_ATOL, NORM_RTOL)


@pytest.mark.parametrize("act", bias_act.ACTS)
@pytest.mark.parametrize("shape", [(1, 7), (33, 65), (200, 4304)], ids=str)
def test_bias_act_gpu(rng, act, shape):
    y = (3 * rng.standard_normal(shape)).astype(np.float32)
    b = rng.standard_normal(shape[1]).astype(np.float32)
    res = rng.standard_normal(shape).astype(np.float32) if act == "residual" else None
    out = poisoned(shape)
    bias_act.gpu(y, b, act, res, out=out)
    want = bias_act.reference(y, b, act, res)
    report_error(f"bias_{act}", want, out)
    assert_close(f"bias {act}", want, out, ACT_ATOL, ACT_RTOL)


@pytest.mark.parametrize("case", [((1, 4, 6), 2, 16), ((1, 28, 28), 16, 72), ((1, 2, 2), 1, 8)],
                         ids=["tiny", "448x448-heads", "one-block"])
def test_vision_attention_gpu(rng, case, monkeypatch):
    grid, heads, d = case
    n = grid[1] * grid[2]
    qkv = rng.standard_normal((n, 3 * heads * d), dtype=np.float32)
    cos, sin = rotary_tables(grid, 2, d, 10000.0)
    want = vision_attention.reference(qkv, cos, sin, heads)
    out = poisoned((n, heads * d))
    vision_attention.gpu(qkv, cos, sin, heads, out=out)
    report_error("vision_attention", want, out)
    assert_close("attention", want, out, ATTN_ATOL, ATTN_RTOL)
    monkeypatch.setattr(vision_attention, "MAX_SCORES", 16 * n)  # query blocks of 16 rows
    out = vision_attention.gpu(qkv, cos, sin, heads)
    assert_close("in query blocks", want, out, ATTN_ATOL, ATTN_RTOL)


def test_gpu_tower_equals_the_cpu_tower(tmp_path):
    """The tiny VLM's tower, and the real tower's widths at two blocks on a 448x448 image."""
    from fermijit.bench import vision as bench_vision
    from fermijit.model import image as mi
    from fermijit.model import multimodal as mm
    from fermijit.model import vision_gpu
    from fermijit.model.config import load_config
    from fermijit.model.vision import VisionTower
    from tests.model import vision_oracle as vo

    directory = vo.write_model(tmp_path / "vlm")
    cfg = load_config(directory)
    tower = mm.load_tower(directory, cfg)
    settings = mi.image_settings(directory, cfg.vision_config)
    images = [mi.preprocess(mi.to_rgb(im), settings) for im in vo.images()]
    want = tower.encode(images)
    got = vision_gpu.make(tower).encode(images)
    report_error("tiny tower", want, got)
    assert_close("tiny tower", want, got, TOWER_REL * float(np.abs(want).max()), 0)

    real = dataclasses.replace(bench_vision.REAL, depth=2)
    tower = VisionTower(real, bench_vision.random_weights(real))
    image = mi.preprocess(bench_vision.synthetic_image(448, 448), mi.ImageSettings())
    want = tower.encode([image])
    got = vision_gpu.make(tower).encode([image])
    report_error("real-width tower", want, got)
    assert_close("real-width tower", want, got, TOWER_REL * float(np.abs(want).max()), 0)
