"""Models for the hybrid-prefill tests: the default one, a tiny one with 128 experts (issue 10 item
3), and full-size shapes with unwritten weights (np.empty: pages never touched) for planning."""

from __future__ import annotations

import numpy as np

from fermijit.model import convert, synth
from fermijit.model.config import parse_config
from fermijit.model.forward import Model
from fermijit.model.weights import QuantTensor, assemble, text_weight_shapes
from tests.model import tiny

# HF_INIT's scales (a residual stream that dominates each layer, as in a trained model) with 128
# experts, top 8, and key/value head dims the GPU's chunked GDN takes (64).
E128 = tiny.Model("hf-init-e128", {**tiny.HF_INIT_TEXT_CONFIG, "num_experts": 128,
                                   "num_experts_per_tok": 8, "linear_key_head_dim": 64,
                                   "linear_value_head_dim": 64}, 0.02, 1.0, 1.0, 0.1)


def tiny_e128(root, lm_head: str = "q4_0"):
    """A converted tiny 128-expert model directory under `root`."""
    hf = tiny.write_checkpoint(root / "hf-e128", model=E128)
    convert.convert(hf, root / "e128", lm_head=lm_head, show_progress=False)
    return root / "e128"


def empty_full_size(name: str) -> Model:
    """A synthetic full-size model (model/synth.py NAMES) whose weights are never written."""
    raw = synth.config_for(name)
    cfg = parse_config(raw).text_config
    tensors = {}
    for field, shape in text_weight_shapes(cfg).items():
        quant = convert.quantisation(field, "q8_0")
        specs = convert.stored_specs(field, shape, quant)
        arrays = [np.empty(s, {"U8": np.uint8, "I8": np.int8, "F16": np.float16,
                               "F32": np.float32}[d]) for _, d, s in specs]
        tensors[field] = arrays[0] if len(arrays) == 1 else QuantTensor(quant, *arrays)
    return Model(cfg, assemble(cfg, tensors))
