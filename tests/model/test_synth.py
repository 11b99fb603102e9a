"""Synthetic full-size models (model/synth.py): the real shapes, the converted format, realistic
scales, a tokenizer over the whole vocabulary; shrunken here (test-only overrides) to stay small."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.model import convert, synth
from fermijit.model.config import load_config, parse_config
from fermijit.model.forward import load_model
from fermijit.model.tokenizer import Tokenizer
from fermijit.ops import quant

REAL_CONFIG = Path(__file__).parent / "data" / "qwen3.6-35b-a3b.config.json"
# Every width shrunk, each inner dimension still a multiple of 32; experts, top-k and the layer
# pattern as the real model's.
SMALL = dict(vocab_size=512, bos_token_id=300, eos_token_id=300, hidden_size=64,
             num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
             moe_intermediate_size=32, shared_expert_intermediate_size=32)
# SMALL with every inner dimension a multiple of 256: the q4_k_m mix then has no 32-block
# fallbacks (Q4_K and Q6_K, as the real shapes).
SMALL_K = dict(SMALL, hidden_size=256, head_dim=128, linear_value_head_dim=64,
               moe_intermediate_size=256, shared_expert_intermediate_size=256)
# Dequantised weights' std vs GAIN / sqrt(K): the +-25 % scale jitter and 8-bit nibble levels
# leave the sample std of a few thousand blocks within ~2 % of it.
STD_RTOL = 0.05


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    dst = tmp_path_factory.mktemp("synth") / "m"
    synth.synth("qwen3.6-35b-a3b-reap128", dst, layers=4, overrides=SMALL, show_progress=False)
    return dst


def test_config_is_the_published_one():
    real = load_config(REAL_CONFIG).text_config
    for name, experts in synth.NAMES.items():
        cfg = parse_config(synth.config_for(name)).text_config
        assert cfg == type(real)(**{**real.__dict__, "num_experts": experts}), name
    cfg = parse_config(synth.config_for("qwen3.6-35b-a3b", layers=5)).text_config
    assert cfg.layer_types == real.layer_types[:5]


def test_small_model_loads_and_runs(small):
    cfg, model = load_model(small)
    assert model.is_quantized and cfg.text_config.num_experts == 128
    manifest = json.loads((small / convert.MANIFEST).read_text())
    assert manifest["tensors"]["lm_head"]["quant"] == "q8_0"  # convert's default
    assert manifest["source"]["path"] == "synthetic:qwen3.6-35b-a3b-reap128"
    state = model.new_state(16)
    logits = model.prefill(np.arange(10, 20), state)
    for _ in range(3):
        logits = model.decode(int(np.argmax(logits)), state)
        assert np.isfinite(logits).all()
    assert 0.3 < logits.std() < 3  # RMS-normalised input, LM head of std 1/sqrt(H)


def test_weights_have_the_intended_scales(small):
    _, w, _ = convert.load_converted(small)
    up = w.layers[0].mlp.experts_gate_up
    values = quant.dequantize_q4_0(np.asarray(up.qs[:8]), np.asarray(up.d[:8]))
    K = up.shape[-1]
    assert abs(values.std() / (synth.GAIN / np.sqrt(K)) - 1) < STD_RTOL
    assert abs(values.mean()) < 0.02 * values.std()  # symmetric nibbles: no bias
    head = w.lm_head
    values = np.asarray(head.qs, np.float32).reshape(-1, 32) * np.asarray(head.d, np.float32
                                                                          ).reshape(-1, 1)
    assert abs(values.std() / (1 / np.sqrt(K)) - 1) < STD_RTOL


def test_bytes_depend_only_on_the_seed(small, tmp_path, monkeypatch):
    """Chunking (and so the thread split) leaves every byte as it was; another seed changes them."""
    monkeypatch.setattr(synth, "CHUNK_BYTES", 4096)
    synth.synth("qwen3.6-35b-a3b-reap128", tmp_path / "a", layers=4, overrides=SMALL,
                show_progress=False)
    assert (tmp_path / "a" / convert.WEIGHTS).read_bytes() == (small / convert.WEIGHTS).read_bytes()
    synth.synth("qwen3.6-35b-a3b-reap128", tmp_path / "b", layers=4, seed=1, overrides=SMALL,
                show_progress=False)
    assert (tmp_path / "b" / convert.WEIGHTS).read_bytes() != (small / convert.WEIGHTS).read_bytes()


def test_tokenizer_covers_the_vocabulary(small):
    tok = Tokenizer(small, 300)
    text = "def f(x):\n    return x  # café ☕ 日本"
    ids = tok.encode(text)
    assert tok._tok.decode(ids.tolist()) == text
    assert tok.eos_ids == frozenset({300})
    assert tok._tok.get_vocab_size() == 512
    assert tok._tok.decode([400, 511]) == " t400 t511"


@pytest.mark.parametrize("mix, overrides", [("q4_0", SMALL), ("q4_k_m", SMALL_K)],
                         ids=["q4_0", "q4_k_m"])
def test_forward_stays_finite_over_40_layers(tmp_path, mix, overrides):
    """The scales' purpose: over the real depth the residual stream stays finite and grows
    gently, and routing spreads over many experts in every layer."""
    synth.synth("qwen3.6-35b-a3b-reap128", tmp_path / "m", overrides=overrides,
                show_progress=False, mix=mix)
    _, model = load_model(tmp_path / "m")
    tokens = np.random.default_rng(0).integers(0, 512, 16)
    rows = synth.layer_stats(model, tokens)
    assert len(rows) == 40
    rms = np.array([r["rms"] for r in rows])
    assert np.isfinite(rms).all() and rms.max() < 50 and rms.min() > 0.5
    # 16 tokens x top-8 of 128: a collapsed router would pick the same 8; uniform picks ~80
    assert min(r["experts"] for r in rows) >= 40


def test_bad_requests_are_errors(small, tmp_path):
    with pytest.raises(FermijitError, match="unknown synthetic model"):
        synth.synth("qwen9", tmp_path / "x")
    with pytest.raises(FermijitError, match="not empty"):
        synth.synth("qwen3.6-35b-a3b-reap128", small, layers=1, overrides=SMALL)


def test_checksums_hashed_while_writing_match_the_file(small):
    """synth hashes the bytes as it writes them (no read-back pass); `verify` reads them back."""
    from fermijit.model import manifest

    manifest.verify(small, show_progress=False)  # raises on any tensor whose bytes differ
    stored = manifest.read_manifest(small)
    weights = convert.SafetensorsFile(small / convert.WEIGHTS)
    for name, entry in stored.tensors.items():
        assert entry.checksum == manifest.checksum(weights, name, entry), name


@pytest.fixture(scope="module")
def small_k(tmp_path_factory):
    dst = tmp_path_factory.mktemp("synth-k") / "m"
    synth.synth("qwen3.6-35b-a3b-reap128", dst, layers=4, overrides=SMALL_K, show_progress=False,
                mix="q4_k_m")
    return dst


def test_q4_k_m_has_the_mixs_kinds_and_scales(small_k):
    """synth --quant q4_k_m: convert's Q4_K_M kinds for the shapes, random blocks whose
    dequantised values have the Q4_0 model's scales (std GAIN/sqrt(K), centred), a model that
    runs."""
    from fermijit.ops import kquant

    cfg, w, manifest = convert.load_converted(small_k)
    shapes = {name: e.shape for name, e in manifest.tensors.items()}
    assert manifest.mix == "q4_k_m"
    assert {n: e.quant for n, e in manifest.tensors.items()} == convert.mix_quants(
        cfg.text_config, shapes, "q4_k_m")
    for tensor, std in ((w.layers[0].mlp.experts_gate_up, synth.GAIN / np.sqrt(256)),
                        (w.lm_head, 1 / np.sqrt(256)), (w.embed_tokens, 1.0)):
        values = kquant.dequantize(kquant.FORMATS[tensor.kind], np.asarray(tensor.blocks[:256]))
        assert abs(values.std() / std - 1) < STD_RTOL, tensor.kind
        # centred in expectation (Q4_K's sub-block offsets: synth.K_SCALE_JITTER)
        assert abs(values.mean()) < 0.03 * values.std(), tensor.kind
    _, model = load_model(small_k)
    state = model.new_state(16)
    logits = model.prefill(np.arange(10, 20), state)
    for _ in range(3):
        logits = model.decode(int(np.argmax(logits)), state)
        assert np.isfinite(logits).all()


def test_q4_k_m_bytes_depend_only_on_the_seed(small_k, tmp_path, monkeypatch):
    monkeypatch.setattr(synth, "CHUNK_BYTES", 4096)  # pieces of 7 Q4_K and 4 Q6_K blocks
    synth.synth("qwen3.6-35b-a3b-reap128", tmp_path / "a", layers=4, overrides=SMALL_K,
                show_progress=False, mix="q4_k_m")
    assert (tmp_path / "a" / convert.WEIGHTS).read_bytes() == (
        small_k / convert.WEIGHTS).read_bytes()
    from fermijit.model import manifest

    manifest.verify(small_k, show_progress=False)


def test_q4_k_m_kinds_it_cannot_draw_are_refused_before_writing(tmp_path, monkeypatch):
    """Q5_1 and Q5_K come only from llama.cpp's 8-expert rules (model/quant_mix.py), which no
    synthetic model meets: synth draws Q4_K, Q6_K and the Q5_0 fallback, and refuses others
    before it writes."""
    mix_quants = convert.mix_quants

    def with_q5_1(*args):
        return {**mix_quants(*args), "layers.0.mlp.shared_down": "q5_1"}

    monkeypatch.setattr(convert, "mix_quants", with_q5_1)
    with pytest.raises(FermijitError, match="no random q5_1 blocks"):
        synth.synth("qwen3.6-35b-a3b-reap128", tmp_path / "m", layers=4, overrides=SMALL,
                    mix="q4_k_m", show_progress=False)
    assert not (tmp_path / "m").exists()


def test_a_smaller_head_through_the_cli(tmp_path, monkeypatch, capsys):
    """synth --lm-head (as convert's): the head in that kind, the rest the mix's, a model that
    runs."""
    from tests.cli import run_cli

    real = synth.config_for
    monkeypatch.setattr(synth, "config_for", lambda name, layers=None, overrides=None: real(
        name, layers, {**SMALL_K, **(overrides or {})}))
    code, _, err = run_cli(monkeypatch, capsys, "synth", "qwen3.6-35b-a3b-reap128",
                           tmp_path / "m", "--layers", "2", "--lm-head", "q6_k")
    assert code == 0, err
    manifest = json.loads((tmp_path / "m" / convert.MANIFEST).read_text())
    assert manifest["tensors"]["lm_head"]["quant"] == "q6_k"
    assert manifest["tensors"]["layers.0.linear_attn.in_proj_qkv"]["quant"] == "q4_0"
    _, model = load_model(tmp_path / "m")
    assert np.isfinite(model.decode(3, model.new_state(4))).all()
