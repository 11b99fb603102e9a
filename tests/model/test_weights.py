"""Checkpoint names to per-layer weights: both expert layouts, prefixes, dtypes, shards, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.model.config import load_config
from fermijit.model.safetensors_io import Checkpoint, save_file
from fermijit.model.weights import (AttentionWeights, GatedDeltaNetWeights, load_text_weights,
                                    plan_text_weights, text_weight_shapes, visual_tensor_names)
from tests.model import tiny

P = "model.language_model."


def expected_fields(dtype: str = "F32") -> dict[str, np.ndarray]:
    """What each weight field must hold: the source values as `dtype` storage rounds them."""
    w = {name: tiny.as_stored(a, tiny.stored_dtype(name, dtype))
         for name, a in tiny.random_weights().items()}
    out = {"embed_tokens": w[P + "embed_tokens.weight"], "norm": w[P + "norm.weight"],
           "lm_head": w["lm_head.weight"]}
    for i in range(tiny.TEXT_CONFIG["num_hidden_layers"]):
        s, n = f"{P}layers.{i}.", f"layers.{i}."
        for name, a in w.items():
            if name.startswith(s + "self_attn.") or name.startswith(s + "linear_attn."):
                field = name[len(s):].removesuffix(".weight")
                out[n + field] = a[:, 0, :] if field.endswith("conv1d") else a
        out[n + "input_layernorm"] = w[s + "input_layernorm.weight"]
        out[n + "post_attention_layernorm"] = w[s + "post_attention_layernorm.weight"]
        m = s + "mlp."
        out[n + "mlp.gate"] = w[m + "gate.weight"]
        out[n + "mlp.experts_gate_up"] = w[m + "experts.gate_up_proj"]
        out[n + "mlp.experts_down"] = w[m + "experts.down_proj"]
        out[n + "mlp.shared_gate_up"] = np.concatenate([w[m + "shared_expert.gate_proj.weight"],
                                                        w[m + "shared_expert.up_proj.weight"]])
        out[n + "mlp.shared_down"] = w[m + "shared_expert.down_proj.weight"]
        out[n + "mlp.shared_expert_gate"] = w[m + "shared_expert_gate.weight"]
    return out


def field(weights, path: str):
    """weights.layers[i].mixer.q_proj for "layers.i.self_attn.q_proj", and so on."""
    parts = path.split(".")
    if parts[0] != "layers":
        return getattr(weights, parts[0])
    layer = weights.layers[int(parts[1])]
    if parts[2] in ("self_attn", "linear_attn"):
        return getattr(layer.mixer, parts[3])
    return getattr(layer.mlp, parts[3]) if parts[2] == "mlp" else getattr(layer, parts[2])


@pytest.mark.parametrize("layout, dtype, n_shards", [
    ("fused", "F32", 1), ("split", "F32", 1), ("fused", "BF16", 1), ("split", "F16", 3),
    ("split", "BF16", 3)], ids=lambda v: str(v))
def test_every_field_holds_its_source(tmp_path, layout, dtype, n_shards):
    d = tiny.write_checkpoint(tmp_path, layout, dtype, n_shards)
    cfg = load_config(d).text_config
    weights = load_text_weights(cfg, Checkpoint(d))
    expected = expected_fields(dtype)
    assert set(expected) == set(plan_text_weights(cfg, Checkpoint(d)))
    for path, a in expected.items():
        got = field(weights, path)
        assert got.dtype == np.float32 and got.shape == a.shape, path
        np.testing.assert_array_equal(got, a, path)  # exact: widening loses nothing
    kinds = [type(layer.mixer) for layer in weights.layers]
    assert kinds == [GatedDeltaNetWeights] * 3 + [AttentionWeights]


def write(directory, tensors: dict[str, np.ndarray], config: dict | None = None):
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or tiny.config_dict()))
    save_file(directory / "model.safetensors", tensors)
    return directory


@pytest.mark.parametrize("layout", ["fused", "split"])
def test_shapes_from_the_config_are_the_plans(tmp_path, layout):
    """The fermijit loader checks its file against text_weight_shapes: the same shapes, the same
    order, as the plans read from a checkpoint."""
    src = tiny.write_checkpoint(tmp_path, layout, model=tiny.HF_INIT)
    cfg = load_config(src).text_config
    plans = plan_text_weights(cfg, Checkpoint(src))
    assert list(text_weight_shapes(cfg).items()) == [(n, p.shape) for n, p in plans.items()]


def test_text_only_prefix(tmp_path):
    """A Qwen3_5MoeForCausalLM save: `model.` prefix, no vision, text-only config."""
    tensors = {name.replace(P, "model."): a for name, a in tiny.random_weights().items()
               if name.startswith(P) or name == "lm_head.weight"}
    d = write(tmp_path / "text", tensors, tiny.TEXT_CONFIG)
    cfg = load_config(d).text_config
    weights = load_text_weights(cfg, Checkpoint(d))
    for path, a in expected_fields().items():
        np.testing.assert_array_equal(field(weights, path), a, path)
    assert visual_tensor_names(Checkpoint(d)) == []


def test_vision_listed_mtp_ignored(tmp_path):
    ck = Checkpoint(tiny.write_checkpoint(tmp_path))
    names = visual_tensor_names(ck)
    assert "model.visual.merger.linear_fc2.weight" in names and len(names) == 21
    cfg = load_config(tmp_path).text_config
    sources = {p.source for plan in plan_text_weights(cfg, ck).values() for p in plan.pieces}
    assert not any(s.startswith(("mtp.", "model.visual.")) for s in sources)


def test_tied_lm_head(tmp_path):
    tensors = tiny.random_weights()
    del tensors["lm_head.weight"]
    config = tiny.config_dict()
    d = write(tmp_path / "untied", tensors, config)
    with pytest.raises(FermijitError, match="missing tensor lm_head.weight"):
        plan_text_weights(load_config(d).text_config, Checkpoint(d))
    config = {**config, "text_config": {**config["text_config"], "tie_word_embeddings": True}}
    d = write(tmp_path / "tied", tensors, config)
    weights = load_text_weights(load_config(d).text_config, Checkpoint(d))
    np.testing.assert_array_equal(weights.lm_head, tensors[P + "embed_tokens.weight"])


def test_chunked_reads_equal_whole(tmp_path):
    """The converter reads an expert's rows in pieces; they must tile the whole tensor."""
    d = tiny.write_checkpoint(tmp_path, "split")
    ck = Checkpoint(d)
    plans = plan_text_weights(load_config(d).text_config, ck)
    plan = plans["layers.0.mlp.experts_gate_up"]  # rows 0-31 gate, 32-63 up: straddle at 32
    whole = plan.read_all(ck)
    for e in (0, 7):
        parts = [plan.read(ck, e, slice(r, r + 24)) for r in range(0, 64, 24)]
        np.testing.assert_array_equal(np.concatenate(parts), whole[e])
    conv = plans["layers.1.linear_attn.conv1d"]
    np.testing.assert_array_equal(conv.read(ck, rows=slice(10, 20)), conv.read_all(ck)[10:20])


@pytest.mark.parametrize("change, message", [
    ("drop:" + P + "layers.3.self_attn.k_norm.weight",
     "missing tensor " + P.replace(".", r"\.") + r"layers\.3\.self_attn\.k_norm\.weight"),
    ("drop:" + P + "layers.1.mlp.experts.down_proj", r"missing tensor .*layers\.1\.mlp\.experts\.down_proj"),
    ("drop:" + P + "embed_tokens.weight", r"missing tensor model\.language_model\.embed_tokens"),
    ("shape:" + P + "layers.2.linear_attn.conv1d.weight",
     r"layers\.2\.linear_attn\.conv1d\.weight has shape \[256, 4\], expected \[256, 1, 4\]"),
    ("dtype:" + P + "layers.0.linear_attn.A_log", r"A_log has dtype I32, expected one of BF16"),
])
def test_bad_tensor_is_named(tmp_path, change, message):
    kind, name = change.split(":", 1)
    tensors = tiny.random_weights()
    if kind == "drop":
        del tensors[name]
    elif kind == "shape":
        tensors[name] = tensors[name][:, 0, :]
    else:
        tensors[name] = tensors[name].astype(np.int32)
    d = write(tmp_path / "bad", tensors)
    with pytest.raises(FermijitError, match=message):
        plan_text_weights(load_config(d).text_config, Checkpoint(d))


def test_split_layout_missing_expert_is_named(tmp_path):
    tensors = tiny.split_experts(tiny.random_weights())
    del tensors[P + "layers.2.mlp.experts.5.up_proj.weight"]
    d = write(tmp_path / "bad", tensors)
    with pytest.raises(FermijitError, match=r"missing tensor .*layers\.2\.mlp\.experts\.5\.up_proj"):
        plan_text_weights(load_config(d).text_config, Checkpoint(d))
