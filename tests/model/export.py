"""A fermijit model written back as an HF checkpoint, dequantised to fp32: what transformers
loads to be the oracle of a model whose unquantised source is not at hand (the embedded default
model's is not committed). config.json and the tokenizer files are copied as they are."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from fermijit.model import convert
from fermijit.model.reference import dense
from fermijit.model.safetensors_io import save_file
from fermijit.model.weights import AttentionWeights


def hf_tensors(weights, prefix: str) -> dict[str, np.ndarray]:
    """TextWeights (quantised or not) as fp32 tensors under the checkpoint names."""
    def f32(a):
        return np.ascontiguousarray(dense(a), dtype=np.float32)

    out = {prefix + "embed_tokens.weight": f32(weights.embed_tokens),
           prefix + "norm.weight": f32(weights.norm), "lm_head.weight": f32(weights.lm_head)}
    for i, layer in enumerate(weights.layers):
        p = f"{prefix}layers.{i}."
        out[p + "input_layernorm.weight"] = f32(layer.input_layernorm)
        out[p + "post_attention_layernorm.weight"] = f32(layer.post_attention_layernorm)
        m = layer.mixer
        if isinstance(m, AttentionWeights):
            for field in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                out[f"{p}self_attn.{field}.weight"] = f32(getattr(m, field))
        else:
            a = p + "linear_attn."
            for field in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "norm",
                          "out_proj"):
                out[f"{a}{field}.weight"] = f32(getattr(m, field))
            out[a + "conv1d.weight"] = f32(m.conv1d)[:, None, :]          # [C, 1, Kc]
            out[a + "A_log"], out[a + "dt_bias"] = f32(m.A_log), f32(m.dt_bias)
        mlp, s = layer.mlp, p + "mlp."
        gate_up, shared = f32(mlp.experts_gate_up), f32(mlp.shared_gate_up)
        out[s + "gate.weight"] = f32(mlp.gate)
        out[s + "experts.gate_up_proj"] = gate_up
        out[s + "experts.down_proj"] = f32(mlp.experts_down)
        half = shared.shape[0] // 2
        out[s + "shared_expert.gate_proj.weight"] = np.ascontiguousarray(shared[:half])
        out[s + "shared_expert.up_proj.weight"] = np.ascontiguousarray(shared[half:])
        out[s + "shared_expert.down_proj.weight"] = f32(mlp.shared_down)
        out[s + "shared_expert_gate.weight"] = f32(mlp.shared_expert_gate)
    return out


def export_hf(model_dir: Path, out_dir: Path) -> Path:
    """`model_dir` (fermijit format) -> `out_dir`, an fp32 HF checkpoint of the same values."""
    cfg, weights, _ = convert.load_converted(model_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = "model.language_model." if cfg.vision_config is not None else "model."
    save_file(out_dir / "model.safetensors", hf_tensors(weights, prefix))
    for name in convert.COPIED_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out_dir / name)
    return out_dir
