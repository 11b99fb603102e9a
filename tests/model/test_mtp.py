"""The MTP head (model/mtp.py, MODEL.md §10; issue 32 item 1): kept by convert, and the layer
against the float64 numpy model of it (model/reference.py `Reference.mtp`: transformers has no
MTP, so the spec written from vLLM's qwen3_5_mtp and llama.cpp's qwen35moe MTP graph is the
oracle), on a tiny model with a random head: the rows prefill computes, a draft's rows, chained
drafts.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.model import convert, mtp
from fermijit.model.forward import load_model
from fermijit.model.reference import Reference
from fermijit.model.state import KvKind
from fermijit.model.weights import MTP_PREFIX
from tests.model import tiny
from tests.numerics import assert_close

# W4A8 against the float64 reference over the same 4-bit weights with the activations quantised
# (Reference(quantize_activations=True)): fp32 rounding, and the main model's own error in the
# hidden states the head reads (tests/model/test_forward.py W4A8_VS_REFERENCE, 1e-5). Measured
# on the rows here: 1.7e-7 (logits), 1.7e-6 of the keys' max.
W4A8_VS_REFERENCE = 1e-5
# fp32 (an HF checkpoint run unquantised) against the float64 reference: summation order.
FP32_VS_REFERENCE = 1e-5


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    hf = tiny.write_checkpoint(root / "hf", model=tiny.MTP)
    convert.convert(hf, root / "fj", show_progress=False)
    return hf, root / "fj"


def rel(expected, actual) -> float:
    return float(np.abs(np.asarray(expected) - actual).max() / np.abs(expected).max())


def test_convert_keeps_the_head(converted, tmp_path):
    hf, fj = converted
    manifest = convert.read_manifest(fj)
    kept = {n: t.quant for n, t in manifest.tensors.items() if n.startswith(MTP_PREFIX)}
    assert kept["mtp.fc"] == "q4_0" and kept["mtp.layers.0.self_attn.q_proj"] == "q4_0"
    assert kept["mtp.layers.0.mlp.experts_gate_up"] == "q4_0"
    assert kept["mtp.pre_fc_norm_hidden"] == kept["mtp.norm"] == "f32"
    assert len(kept) == 3 + 14 + 1  # pre-fc norms, fc; the layer's fields; the final norm
    _, model = load_model(fj)
    assert model.mtp is not None
    # A checkpoint with only the lone mtp.fc most files here carry has no head.
    lone = tiny.write_checkpoint(tmp_path / "hf", model=tiny.HF_INIT)
    convert.convert(lone, tmp_path / "fj", show_progress=False)
    assert not any(n.startswith(MTP_PREFIX) for n in convert.read_manifest(tmp_path / "fj").tensors)
    assert load_model(tmp_path / "fj")[1].mtp is None
    with pytest.raises(FermijitError, match="no MTP head"):
        load_model(tmp_path / "fj")[1].new_state(8, mtp=True)


def _compare(model, ref, prompt, tolerance, like_decode=False):
    """Prefill `prompt` with the head; then a draft's row and two chained ones (through
    decode's kernels with `like_decode`, as the Speculator drafts); each against the
    reference."""
    state = model.new_state(64, mtp=True)
    rs = ref.new_state()
    hidden = ref.hidden(prompt, rs)                                 # [P, H]
    cache = ref.new_mtp_cache()
    ref.mtp(prompt[1:], hidden[:-1], cache)                         # prefill's rows 0 .. P-2
    model.prefill(prompt, state)
    assert state.hidden.shape == (1, model.hidden)
    assert rel(hidden[-1:], state.hidden) < tolerance
    kv = mtp.cache(model, state)
    n = prompt.size - 1
    assert rel(cache.k, kv.k[:, :n].transpose(1, 0, 2)) < tolerance
    assert rel(cache.v, kv.v[:, :n].transpose(1, 0, 2)) < tolerance
    kv.k[:, n:] = np.nan                                            # rows not yet written
    kv.v[:, n:] = np.nan
    token = 7
    want_logits, want_out = ref.mtp([token], hidden[-1:], cache)    # row P-1
    out, logits = mtp.consume(model, state, [token], like_decode=like_decode)
    assert state.hidden.shape == (0, model.hidden)
    assert rel(want_logits[0], logits) < tolerance
    assert rel(want_out, out) < tolerance
    for step, draft in enumerate((11, 3)):                          # chained: own output as hidden
        want_logits, next_out = ref.mtp([draft], want_out, cache)
        out, logits = mtp.chain(model, state, prompt.size + step, draft, out[-1],
                                like_decode=like_decode)
        assert rel(want_logits[0], logits) < tolerance, step
        want_out = next_out
    assert not np.isnan(kv.k[:, :prompt.size + 2]).any()


# Against the float64 reference, whose KV cache is fp32: the Q8_0 cache's head runs in
# tests/fermijit/test_speculative.py (speculative decoding bit for bit plain decoding's).
def test_layer_w4a8_matches_the_reference(converted, rng):
    cfg, model = load_model(converted[1], kv=KvKind.F32)
    _, weights, _ = convert.load_converted(converted[1])
    ref = Reference(cfg.text_config, weights, quantize_activations=True)
    assert mtp._takes_decode_rows(model)
    for n in (2, 9, 20):
        prompt = rng.integers(0, model.vocab_size, n).astype(np.int32)
        for like_decode in (False, True):  # prefill's ops, decode's kernels (the drafts')
            _compare(model, ref, prompt, W4A8_VS_REFERENCE, like_decode)


def test_layer_fp32_matches_the_reference(converted, rng):
    from fermijit.model.config import load_config
    from fermijit.model.safetensors_io import Checkpoint
    from fermijit.model.weights import load_text_weights

    hf = converted[0]
    cfg, model = load_model(hf, kv=KvKind.F32)                      # fp32, as the HF file
    weights = load_text_weights(cfg.text_config, Checkpoint(hf))
    assert weights.mtp is not None and load_config(hf).text_config.mtp_num_hidden_layers == 1
    ref = Reference(cfg.text_config, weights)
    _compare(model, ref, rng.integers(0, model.vocab_size, 13).astype(np.int32),
             FP32_VS_REFERENCE)


def test_prefill_in_blocks_gives_the_same_rows(converted, rng, monkeypatch):
    # The head's rows cross prefill passes (a pass's last hidden state waits for the next pass's
    # first token): passes of 5 against one pass.
    from fermijit.model import forward

    _, model = load_model(converted[1], kv=KvKind.F32)
    prompt = rng.integers(0, model.vocab_size, 23).astype(np.int32)
    whole = model.new_state(32, mtp=True)
    model.prefill(prompt, whole)
    monkeypatch.setattr(forward, "PREFILL_BLOCK", 5)
    parts = model.new_state(32, mtp=True)
    model.prefill(prompt, parts)
    n = prompt.size - 1
    assert rel(whole.layers[-1].k[:, :n], parts.layers[-1].k[:, :n]) < W4A8_VS_REFERENCE
    assert rel(whole.hidden, parts.hidden) < W4A8_VS_REFERENCE


def test_bad_calls_are_refused(converted):
    _, model = load_model(converted[1])
    plain = model.new_state(8)
    with pytest.raises(FermijitError, match="without the MTP layer"):
        mtp.consume(model, plain, [1])
    state = model.new_state(8, mtp=True)
    model.prefill(np.array([1, 2, 3], np.int32), state)
    with pytest.raises(FermijitError, match="2 tokens for 1 waiting"):
        mtp.consume(model, state, [1, 2])
    with pytest.raises(FermijitError, match="token ids"):
        mtp.consume(model, state, [model.vocab_size])
    with pytest.raises(FermijitError, match="exceed the context"):
        mtp.chain(model, state, 8, 1, np.zeros(model.hidden, np.float32))


def test_prune_keeps_the_heads_experts_consistently(converted, tmp_path, rng):
    # The head's experts are pruned by their own row of kept ids (kept[L]); an HF checkpoint
    # pruned then converted is the fermijit model pruned directly; both run.
    import safetensors.numpy

    from fermijit.model import prune

    hf, fj = converted
    cfg = convert.load_converted(fj)[0].text_config
    L, E = cfg.num_hidden_layers, cfg.num_experts
    kept = np.sort(np.stack([rng.permutation(E)[:E - 5] for _ in range(L + 1)]), axis=1)
    with pytest.raises(FermijitError, match="kept experts must be"):
        prune.prune_fermijit(fj, tmp_path / "short", kept[:L], {"criterion": "random"})
    prune.prune_fermijit(fj, tmp_path / "direct", kept, {"criterion": "random"})
    prune.prune_hf(hf, tmp_path / "hf", kept, {"criterion": "random"})
    convert.convert(tmp_path / "hf", tmp_path / "converted", show_progress=False)
    a = safetensors.numpy.load_file(tmp_path / "converted" / convert.WEIGHTS)
    b = safetensors.numpy.load_file(tmp_path / "direct" / convert.WEIGHTS)
    before = safetensors.numpy.load_file(fj / convert.WEIGHTS)
    assert set(a) == set(b) == set(before)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], name)
    for field in ("gate", "experts_gate_up.qs", "experts_down.d"):
        name = f"mtp.layers.0.mlp.{field}"
        np.testing.assert_array_equal(b[name], before[name][kept[L]], name)
    for d in (tmp_path / "direct", tmp_path / "converted"):
        _, model = load_model(d)
        assert model.mtp.layer.router.shape[0] == E - 5
        state = model.new_state(16, mtp=True)
        model.prefill(np.arange(5, dtype=np.int32), state)
        assert np.isfinite(mtp.consume(model, state, [3])[1]).all()


def test_calibration_counts_the_heads_rows(converted, rng):
    # REAP sees the head's MoE as layer L: every row the prefill computes (all but a window's
    # last, which waits for its next token) routed to top_k experts.
    from fermijit.model import reap

    _, model = load_model(converted[1])
    context, n_windows = 16, 3
    tokens = rng.integers(0, model.vocab_size, context * n_windows).astype(np.int32)
    cal = reap.calibrate(model, tokens, context, "random")
    L = len(model.layers)
    assert cal.counts.shape == (L + 1, model.n_experts)
    assert cal.counts[L].sum() == n_windows * (context - 1) * model.top_k
    assert cal.counts[0].sum() == n_windows * context * model.top_k


def with_nextn_block(src, dst, hf_weights: dict) -> None:
    """A copy of GGUF `src` (llama.cpp's conversion of a tiny model without its head) with the
    head added as llama.cpp's converter writes it: block blk.{L} after the L layers
    (block_count + 1, nextn_predict_layers 1), its layer under the block names, nextn.eh_proj /
    enorm / hnorm / shared_head_norm, the routed experts' gate_up split, every norm but the GDN
    one stored 1 + w (model/gguf_io.py undoes each)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(src)
    L = int(reader.fields["qwen35moe.block_count"].contents())
    writer = GGUFWriter(dst, "qwen35moe")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if key == "qwen35moe.block_count":
            value = L + 1
        elif key == "qwen35moe.attention.recurrent_layers":
            value = list(value) + [False]
        sub = field.types[1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub)
    writer.add_key_value("qwen35moe.nextn_predict_layers", 1, GGUFValueType.UINT32)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data))
    b, m = f"blk.{L}.", "mtp.layers.0."

    def norm(name):
        return (1 + hf_weights[name]).astype(np.float32)

    gate_up = hf_weights[m + "mlp.experts.gate_up_proj"]
    half = gate_up.shape[1] // 2
    head = {"nextn.eh_proj.weight": hf_weights["mtp.fc.weight"],
            "nextn.enorm.weight": norm("mtp.pre_fc_norm_embedding.weight"),
            "nextn.hnorm.weight": norm("mtp.pre_fc_norm_hidden.weight"),
            "nextn.shared_head_norm.weight": norm("mtp.norm.weight"),
            "attn_norm.weight": norm(m + "input_layernorm.weight"),
            "post_attention_norm.weight": norm(m + "post_attention_layernorm.weight"),
            "attn_q_norm.weight": norm(m + "self_attn.q_norm.weight"),
            "attn_k_norm.weight": norm(m + "self_attn.k_norm.weight"),
            "ffn_gate_exps.weight": gate_up[:, :half], "ffn_up_exps.weight": gate_up[:, half:],
            "ffn_down_exps.weight": hf_weights[m + "mlp.experts.down_proj"]}
    for ours, theirs in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"),
                         ("o_proj", "attn_output")):
        head[theirs + ".weight"] = hf_weights[f"{m}self_attn.{ours}.weight"]
    for ours, theirs in (("gate", "ffn_gate_inp"), ("shared_expert.gate_proj", "ffn_gate_shexp"),
                         ("shared_expert.up_proj", "ffn_up_shexp"),
                         ("shared_expert.down_proj", "ffn_down_shexp"),
                         ("shared_expert_gate", "ffn_gate_inp_shexp")):
        head[theirs + ".weight"] = hf_weights[f"{m}mlp.{ours}.weight"]
    for name, a in head.items():
        writer.add_tensor(b + name, np.ascontiguousarray(a, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_nextn_block_converts_as_the_hf_head(tmp_path):
    # llama.cpp's layout of the head (its qwen35moe MTP graph's tensors) converts to the same
    # fermijit tensors as the HF checkpoint's mtp.*: quantised ones byte for byte, norms within
    # the ulp that storing 1 + w costs.
    from fermijit.model.safetensors_io import SafetensorsFile
    from tests.model import gguf_data

    model = dataclasses.replace(tiny.UNIT, mtp=True)
    hf = gguf_data.write_checkpoint(tmp_path / "hf", model)
    with_nextn_block(gguf_data.F32, tmp_path / "mtp.gguf", tiny.random_weights(0, model))
    convert.convert(hf, tmp_path / "ours", show_progress=False)
    convert.convert(tmp_path / "mtp.gguf", tmp_path / "theirs", show_progress=False)
    a = SafetensorsFile(tmp_path / "ours" / convert.WEIGHTS)
    b = SafetensorsFile(tmp_path / "theirs" / convert.WEIGHTS)
    head = sorted(n for n in a.tensors if n.startswith(MTP_PREFIX))
    assert head and head == sorted(n for n in b.tensors if n.startswith(MTP_PREFIX))
    for name in head:
        x, y = np.asarray(a.raw(name)), np.asarray(b.raw(name))
        if x.dtype == np.float32:
            assert_close(name, x, y, atol=2 * np.finfo(np.float32).eps * 4, rtol=0)
        else:
            assert x.tobytes() == y.tobytes(), name
    assert load_model(tmp_path / "theirs")[1].mtp is not None
