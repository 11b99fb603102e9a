"""config.json parsing. data/qwen3.6-35b-a3b.config.json is the published file as MODEL.md §2 and
third-party copies of it describe it (every field they list, layer_types spelled out)."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from fermijit import FermijitError
from fermijit.model.config import ModelConfig, load_config, parse_config
from tests.model import tiny

REAL = Path(__file__).parent / "data" / "qwen3.6-35b-a3b.config.json"


def real() -> dict:
    return json.loads(REAL.read_text())


def test_published_config():
    c = load_config(REAL)
    t = c.text_config
    assert (t.hidden_size, t.num_hidden_layers, t.vocab_size, t.head_dim) == (2048, 40, 248320, 256)
    assert [i for i, k in enumerate(t.layer_types) if k == "full_attention"] == list(range(3, 40, 4))
    assert (t.linear_key_dim, t.linear_value_dim, t.linear_conv_dim) == (2048, 4096, 8192)
    assert (t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size) == (256, 8, 512)
    assert t.rope_parameters.rope_theta == 1e7 and t.rotary_dim == 64
    assert t.rope_parameters.mrope_section == (11, 11, 10) and t.rope_parameters.mrope_interleaved
    assert (t.rms_norm_eps, t.eos_token_id, t.max_position_embeddings) == (1e-6, 248044, 262144)
    assert c.vision_config.depth == 27 and c.vision_config.out_hidden_size == 2048
    assert (c.image_token_id, c.vision_start_token_id, c.vision_end_token_id) == (248056, 248053,
                                                                                  248054)


def test_text_only_config_and_directory(tmp_path):
    text = real()["text_config"]
    (tmp_path / "config.json").write_text(json.dumps(text))
    c = load_config(tmp_path)
    assert c.model_type == "qwen3_5_moe_text" and c.vision_config is None
    assert c.text_config == load_config(REAL).text_config


def test_rope_theta_gotcha():
    """Without rope_parameters the theta is transformers' 10000, not the real model's 1e7."""
    base = {"model_type": "qwen3_5_moe_text"}
    assert parse_config(base).text_config.rope_parameters.rope_theta == 10000.0
    legacy = parse_config({**base, "rope_theta": 1e7, "partial_rotary_factor": 0.5})
    assert legacy.text_config.rope_parameters.rope_theta == 1e7
    assert legacy.text_config.rotary_dim == 128
    both = parse_config({**base, "rope_theta": 5.0, "rope_parameters": {"rope_theta": 1e7}})
    assert both.text_config.rope_parameters.rope_theta == 1e7  # rope_parameters wins


def test_layer_types_default_from_interval():
    c = parse_config({"model_type": "qwen3_5_moe_text", "num_hidden_layers": 6,
                      "full_attention_interval": 2,
                      "rope_parameters": {"mrope_section": [11, 11, 10]}})
    assert c.text_config.layer_types == ("linear_attention", "full_attention") * 3


def mutated(path: tuple, value) -> dict:
    raw = real()
    node = raw
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return raw


@pytest.mark.parametrize("path, value, message", [
    (("norm_topk_prob",), True, "unknown field 'norm_topk_prob'"),
    (("text_config", "norm_topk_prob"), True, "text_config: unknown field 'norm_topk_prob'"),
    (("text_config", "rope_parameters", "factor"), 4.0, "rope_parameters: unknown field 'factor'"),
    (("vision_config", "patch"), 3, "vision_config: unknown field 'patch'"),
    (("model_type",), "qwen3_next", "unsupported model_type 'qwen3_next'"),
    (("model_type",), KeyError, "missing required field 'model_type'"),
    (("text_config",), KeyError, "missing required field 'text_config'"),
    (("text_config", "model_type"), "qwen3_5_text", "unsupported model_type 'qwen3_5_text'"),
    (("text_config", "hidden_size"), "2048", "text_config: hidden_size: expected int"),
    (("text_config", "eos_token_id"), 1.5, "eos_token_id: expected int | tuple"),
    (("text_config", "layer_types"), ["linear_attention"] * 39, "layer_types has 39 entries"),
    (("text_config", "rope_parameters", "rope_type"), "yarn", "unsupported rope_type 'yarn'"),
    (("text_config", "rope_parameters", "mrope_section"), "11", "mrope_section: expected"),
    (("text_config", "mlp_only_layers"), [0], "mlp_only_layers must be empty"),
    (("text_config", "num_key_value_heads"), 3, "multiple of num_key_value_heads"),
    (("text_config", "num_experts_per_tok"), 300, "num_experts_per_tok exceeds"),
    (("text_config", "hidden_act"), "gelu", "unsupported hidden_act"),
    # issue 11 cases 1 and 10: non-finite floats; sizes bounded before anything is built
    (("text_config", "rms_norm_eps"), float("inf"), "Infinity is not a number JSON allows"),
    (("text_config", "rope_parameters", "rope_theta"), float("nan"), "NaN is not a number"),
    (("text_config", "num_hidden_layers"), 10 ** 9, "num_hidden_layers 1000000000 is beyond"),
    (("text_config", "vocab_size"), 2 ** 40, "vocab_size 1099511627776 is beyond"),
])
def test_bad_config(tmp_path, path, value, message):
    file = tmp_path / "config.json"
    file.write_text(json.dumps(mutated(path, value)))
    with pytest.raises(FermijitError, match=message.replace("(", r"\(").replace("|", r"\|")) as e:
        load_config(file)
    assert str(file) in str(e.value) and "\n" not in str(e.value)


def test_non_finite_floats_are_type_errors():
    """From a dict (not through the JSON reader) too: a float field must be finite."""
    with pytest.raises(FermijitError, match="rms_norm_eps: expected finite float, got Infinity"):
        parse_config(mutated(("text_config", "rms_norm_eps"), float("inf")))


def test_a_billion_layers_fail_fast(tmp_path):
    """Without layer_types, num_hidden_layers 1e9 built a billion-entry tuple first (a hang)."""
    import time

    raw = mutated(("text_config", "layer_types"), KeyError)
    raw["text_config"]["num_hidden_layers"] = 10 ** 9
    start = time.perf_counter()
    with pytest.raises(FermijitError, match="num_hidden_layers 1000000000 is beyond 1024"):
        parse_config(raw)
    assert time.perf_counter() - start < 5  # a bound no loaded CI machine reaches: it was hours


def test_unreadable_config(tmp_path):
    with pytest.raises(FermijitError, match="no config file"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(FermijitError, match="not valid JSON"):
        load_config(tmp_path)


def test_eos_list_and_frozen():
    raw = mutated(("text_config", "eos_token_id"), [248046, 248044])
    c = parse_config(raw)
    assert c.text_config.eos_token_id == (248046, 248044)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.text_config.hidden_size = 1


def ours_vs_transformers(ours: ModelConfig, theirs) -> None:
    """Every field we hold equals transformers' value for it (defaults included)."""
    t, tt = ours.text_config, theirs.text_config
    for f in dataclasses.fields(t):
        if f.name in ("rope_parameters", "layer_types", "eos_token_id", "mlp_only_layers"):
            continue
        if hasattr(tt, f.name):
            assert getattr(t, f.name) == getattr(tt, f.name), f.name
    assert list(t.layer_types) == list(tt.layer_types)
    rp = tt.rope_parameters
    assert t.rope_parameters.rope_theta == rp["rope_theta"]
    assert t.rope_parameters.partial_rotary_factor == rp["partial_rotary_factor"]
    assert list(t.rope_parameters.mrope_section) == list(rp.get("mrope_section", [11, 11, 10]))
    for f in dataclasses.fields(ours.vision_config):
        if hasattr(theirs.vision_config, f.name) and f.name != "deepstack_visual_indexes":
            assert getattr(ours.vision_config, f.name) == getattr(theirs.vision_config, f.name)
    for name in ("image_token_id", "video_token_id", "vision_start_token_id",
                 "vision_end_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name


@pytest.mark.parametrize("raw", [
    pytest.param(lambda: real(), id="published"),
    pytest.param(lambda: tiny.config_dict(), id="tiny"),
    pytest.param(lambda: {"model_type": "qwen3_5_moe", "text_config": {}}, id="all-defaults"),
])
def test_agrees_with_transformers(tmp_path, raw):
    """Same values as transformers reads, and transformers' own saved file parses."""
    transformers = pytest.importorskip("transformers")
    raw = raw()
    theirs = transformers.Qwen3_5MoeConfig.from_dict(copy.deepcopy(raw))
    ours_vs_transformers(parse_config(raw), theirs)
    theirs.save_pretrained(tmp_path)
    ours_vs_transformers(load_config(tmp_path), theirs)
