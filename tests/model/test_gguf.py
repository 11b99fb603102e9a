"""GGUF in (issue 16): llama.cpp's own conversion of a tiny random checkpoint (README in
tests/model/data/gguf) read back equals the checkpoint: fp32 logits, fermijit's quantised blocks,
the tokenizer; malformed files are one-line errors."""

from __future__ import annotations

import dataclasses
import json
import struct
import sys

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.model import convert, gguf_convert, gguf_io
from fermijit.model.forward import Model, load_model
from fermijit.model.safetensors_io import SafetensorsFile
from fermijit.model.tokenizer import Tokenizer
from tests.model import gguf_data
from tests.numerics import assert_close
from tests.cli import run_cli

pytest.importorskip("gguf")

# Every llama.cpp transform is undone exactly but two, each within an ulp of its value: the norms'
# 1 + w (rounded at 1's exponent: 6e-8) and A_log's -exp. Measured: logits equal to the last bit.
LOGITS_ATOL = 1e-5
NORM_ULP = 2.0 ** -24  # |(1 + w) - 1 - w| for |w| < 1
TOKENS = np.array([5, 17, 100, 3, 250, 9, 42, 1, 299, 0, 64], np.int32)
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello   world!\n\n  x's  don't 123",
         "<|im_start|>user\nhi<|im_end|>", "", "ﬁ café naïve 日本語 🚀\r\n\tend"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The HF checkpoint the GGUF files were made from (regenerated: it is seeded)."""
    return gguf_data.write_checkpoint(tmp_path_factory.mktemp("gguf") / "tiny-hf")


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
    """converted(source) -> fermijit's conversion of the HF checkpoint or of a GGUF file, once."""
    root, made = tmp_path_factory.mktemp("gguf-converted"), {}

    def get(src):
        if src not in made:
            made[src] = root / src.name.replace(".", "-")
            convert.convert(src, made[src], show_progress=False)
        return made[src]

    return get


def all_logits(model) -> np.ndarray:
    state = model.new_state(TOKENS.size)
    return model.prefill(TOKENS, state, all_logits=True)


def test_f32_gguf_logits_equal_the_checkpoint(hf_dir):
    cfg, weights = gguf_convert.load_float_weights(gguf_data.F32)
    hf_cfg, hf_model = load_model(hf_dir)
    # All but the token ids (the GGUF's are the tokenizer's) and MTP (converted without it).
    ignored = dict(pad_token_id=None, eos_token_id=None, mtp_num_hidden_layers=0)
    assert (dataclasses.replace(cfg.text_config, **ignored)
            == dataclasses.replace(hf_cfg.text_config, **ignored))
    assert_close("fp32 logits from the F32 GGUF", all_logits(hf_model),
                 all_logits(Model(cfg.text_config, weights)), atol=LOGITS_ATOL, rtol=0)


def test_f32_gguf_converts_to_fermijits_own_conversion(hf_dir, converted):
    """Every quantised tensor byte for byte (the V-head reorder is undone exactly), the fp32 ones
    within an ulp, and the W4A8 logits equal."""
    ours, theirs = converted(hf_dir), converted(gguf_data.F32)
    a, b = SafetensorsFile(ours / convert.WEIGHTS), SafetensorsFile(theirs / convert.WEIGHTS)
    # A GGUF holds no vision tower (llama.cpp keeps it in a separate mmproj file).
    names = {n for n in a.tensors if not n.startswith("visual.")}
    assert names == set(b.tensors)
    for name in names:
        x, y = np.asarray(a.raw(name)), np.asarray(b.raw(name))
        if x.dtype == np.float32:
            assert_close(name, x, y, atol=NORM_ULP * 2, rtol=0)
        else:
            assert x.tobytes() == y.tobytes(), name
    assert_close("W4A8 logits", all_logits(load_model(ours)[1]),
                 all_logits(load_model(theirs)[1]), atol=LOGITS_ATOL, rtol=0)


def test_tokenizer_from_metadata_equals_the_checkpoints(hf_dir, converted):
    hf, ours = Tokenizer(hf_dir), Tokenizer(converted(gguf_data.F32))
    for text in TEXTS:
        ids = hf.encode(text)
        assert ours.encode(text).tolist() == ids.tolist(), text
        assert ours.decode(ids) == hf.decode(ids)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.render_chat(chat) == hf.render_chat(chat)
    assert ours.eos_ids == {3}  # tokenizer_config's eos, the one llama.cpp stores


def malformed(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def bad_files(tmp_path) -> dict:
    """One broken copy of the F32 file per way a GGUF can be broken."""
    import gguf

    good = gguf_data.F32.read_bytes()
    last = gguf.GGUFReader(gguf_data.F32).tensors[-1].field  # its last part: the data offset
    at = last.offset + sum(p.nbytes for p in last.parts[:-1])
    first_arch = good.index(b"qwen35moe")  # general.architecture's value comes first
    return {
        "truncated": good[:len(good) // 2],
        "header cut": good[:200],
        "bad magic": b"GGUX" + good[4:],
        "wrong version": good[:4] + struct.pack("<I", 99) + good[8:],
        "data out of range": good[:at] + struct.pack("<Q", 1 << 40) + good[at + 8:],
        "unknown arch": good[:first_arch] + b"mamba2xyz" + good[first_arch + 9:],
    }


def test_malformed_gguf_is_a_one_line_error(tmp_path):
    for what, data in bad_files(tmp_path).items():
        path = malformed(tmp_path, what.replace(" ", "-") + ".gguf", data)
        with pytest.raises(FermijitError) as e:
            convert.convert(path, tmp_path / "out", show_progress=False)
        message = str(e.value)
        assert "\n" not in message and str(path) in message, (what, message)
        assert not (tmp_path / "out").exists(), what
    unknown = malformed(tmp_path, "arch.gguf", bad_files(tmp_path)["unknown arch"])
    with pytest.raises(FermijitError, match="unsupported architecture 'mamba2xyz'"):
        gguf_io.GgufFile(unknown)


@pytest.mark.parametrize("verb", ["convert", "generate", "eval"])
def test_cli_refuses_a_malformed_gguf_in_one_line(verb, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FERMIJIT_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "text.txt"
    text.write_text("hello")
    for what, data in bad_files(tmp_path).items():
        path = malformed(tmp_path, what.replace(" ", "-") + ".gguf", data)
        args = {"convert": ["convert", path, tmp_path / "out"],
                "generate": ["generate", "--model", path, "hi"],
                "eval": ["eval", "--model", path, "--text", text]}[verb]
        code, _, err = run_cli(monkeypatch, capsys, *args)
        assert code == 2, (what, err)
        assert err.count("\n") == 1 and err.startswith("Error: "), (what, err)


def test_generate_model_gguf_converts_once_into_the_cache(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FERMIJIT_CACHE", str(tmp_path / "cache"))
    first = gguf_convert.model_directory(gguf_data.F32)
    assert "converting" in capsys.readouterr().err
    assert convert.is_fermijit_model(first) and first.parent == tmp_path / "cache" / "gguf"
    assert gguf_convert.model_directory(gguf_data.F32) == first
    assert capsys.readouterr().err == ""  # the second run loads the cached conversion
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no partial left behind
    manifest = json.loads((first / convert.MANIFEST).read_text())
    assert manifest["source"]["format"] == "gguf" and manifest["source"]["requantised"] == {}


def test_value_heads_return_to_grouped_order():
    """llama.cpp's _reorder_v_heads (grouped by key head -> tiled), in numpy; ours inverts it."""
    Hk, Hv, d = 2, 6, 3
    grouped = np.arange(Hv * d)
    tiled = grouped.reshape(Hk, Hv // Hk, d).transpose(1, 0, 2).reshape(-1)
    assert (tiled[gguf_io.grouped_from_tiled(Hk, Hv, d)] == grouped).all()


@pytest.mark.parametrize("path", [gguf_data.Q4_0, gguf_data.Q8_0], ids=["q4_0", "q8_0"])
def test_quantised_gguf_blocks_are_imported_bit_for_bit(path, hf_dir, converted, capsys):
    """llama.cpp's Q4_0/Q8_0 blocks, reordered back, are byte for byte the blocks fermijit's own
    conversion makes of the checkpoint (both round as GGML's reference quantiser); what fermijit
    stores otherwise (the fp16 embedding) is requantised, said in one warning; the rest is
    dequantised into fp32 fields. (Q8_0 experts run as they are: model/block_moe.py.)"""
    import gguf

    from fermijit.model.safetensors_io import Checkpoint
    from fermijit.model.weights import plan_text_weights
    from fermijit.ops import quant

    ours = converted(hf_dir)
    capsys.readouterr()
    theirs = converted(path)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    manifest = json.loads((theirs / convert.MANIFEST).read_text())
    ours_manifest = json.loads((ours / convert.MANIFEST).read_text())
    imported, requantised = manifest["source"]["imported_blocks"], manifest["source"]["requantised"]
    plans = plan_text_weights(load_model(hf_dir)[0].text_config, Checkpoint(hf_dir))
    a, b = SafetensorsFile(ours / convert.WEIGHTS), SafetensorsFile(theirs / convert.WEIGHTS)
    for name in imported:
        kind = manifest["tensors"][name]["quant"]
        if ours_manifest["tensors"][name]["quant"] == kind:   # fermijit's own conversion
            qs, d = np.asarray(a.raw(name + ".qs")), np.asarray(a.raw(name + ".d"))
        else:                                                  # the same quantiser, another kind
            qs, d = quant.quantize_q8_0(plans[name].read_all(Checkpoint(hf_dir)))
        assert np.asarray(b.raw(name + ".qs")).tobytes() == qs.tobytes(), name
        assert np.asarray(b.raw(name + ".d")).tobytes() == d.tobytes(), name
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    kind = path.stem.split("-")[-1].upper()
    expected = {"token_embd.weight": kind}  # fp16 in fermijit
    assert requantised == expected
    assert len(warnings) == 1 and f"{len(expected)} tensor" in warnings[0]
    fields = gguf_io.plan_fields(load_model(hf_dir)[0].text_config, gguf_io.GgufFile(path))
    quantised = {n for n, t in types.items() if t not in ("F32", "F16", "BF16")}
    for name, field in fields.items():  # every quantised tensor went one of the three ways
        if set(field.sources) & quantised and name not in imported:
            assert (manifest["tensors"][name]["quant"] == "f32"
                    or set(field.sources) <= set(requantised)), name
    # Every quantised matrix field: 7 per linear-attention layer, 8 per attention layer, lm_head.
    assert len(imported) == 30


# Q4_K (the coarsest type in the file) keeps weights to ~4% relative RMS error; a field read
# with a transform left undone (a permutation, the 1 + w) is off by ~100% or more.
KQUANT_REL_RMS = 0.1


def test_k_quants_are_imported_as_their_blocks_with_no_warning(tmp_path_factory, capsys):
    """llama.cpp's Q4_K_M (Q4_K, Q5_0, Q5_1, Q6_K and Q8_0 tensors) of the 256-wide tiny model
    (issue 34): nothing is requantised. Every field in a block kind keeps its blocks bit for bit
    (their values, dequantised, are gguf's dequantisation of the GGUF's, transforms undone, and
    near the checkpoint's weights); Q8_0 fields are imported as Q8_0; the fp32 fields are the
    dequantised values."""
    from fermijit.model.safetensors_io import Checkpoint
    from fermijit.model.weights import plan_text_weights
    from fermijit.ops import kquant

    root = tmp_path_factory.mktemp("gguf-wide")
    hf = gguf_data.write_checkpoint(root / "hf", gguf_data.WIDE)
    out = root / "out"
    convert.convert(gguf_data.Q4_K_M, out, show_progress=False)
    assert "warning" not in capsys.readouterr().err
    manifest = json.loads((out / convert.MANIFEST).read_text())
    assert manifest["source"]["requantised"] == {}
    g = gguf_io.GgufFile(gguf_data.Q4_K_M)
    cfg = load_model(hf)[0].text_config
    plans, weights = plan_text_weights(cfg, Checkpoint(hf)), SafetensorsFile(out / convert.WEIGHTS)
    kinds = set()
    for name, field in gguf_io.plan_fields(cfg, g).items():
        entry = manifest["tensors"][name]
        kinds.add(entry["quant"])
        if entry["quant"] not in kquant.FORMATS:
            assert entry["quant"] == "f32" or name in manifest["source"]["imported_blocks"], name
            continue
        assert name in manifest["source"]["imported_blocks"], name
        leads = range(field.shape[0]) if len(field.shape) == 3 else [None]
        values = np.stack([gguf_io.read_float(field, g, e, slice(None)) for e in leads])
        values = values.reshape(field.shape)
        stored = kquant.dequantize(kquant.FORMATS[entry["quant"]],
                                   np.asarray(weights.raw(name + ".blocks")))
        np.testing.assert_array_equal(stored.view(np.uint32), values.view(np.uint32))
        expected = plans[name].read_all(Checkpoint(hf))
        err = np.sqrt(np.mean((values - expected) ** 2) / np.mean(expected ** 2))
        assert err < KQUANT_REL_RMS, (name, err)
    assert {"q4_k", "q5_0", "q5_1", "q6_k", "q8_0", "f32"} <= kinds


def test_generate_chat_runs_from_a_gguf_alone(hf_dir, tmp_path, monkeypatch, capsysbinary):
    """`generate --chat --model FILE.gguf`: weights, tokenizer and chat template all from the file."""
    monkeypatch.setenv("FERMIJIT_CACHE", str(tmp_path / "cache"))
    from fermijit import cli

    monkeypatch.setattr(sys, "argv", ["fermijit", "generate", "--model", str(gguf_data.Q4_0),
                                      "--chat", "--max-tokens", "4", "--temperature", "0", "hi"])
    cli.main()
    _, err = capsysbinary.readouterr()
    hf = Tokenizer(hf_dir)  # the prompt as the checkpoint's own tokenizer and template make it
    n_prompt = hf.encode(hf.render_chat([{"role": "user", "content": "hi"}]),
                         add_special_tokens=False).size
    assert f"prompt {n_prompt} tokens (0 from the cache);".encode() in err, err
    assert b" tokens, decode " in err and b"Error" not in err  # a random model may stop at once
