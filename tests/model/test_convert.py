"""The converter and the fermijit format: exact round trip (issue 3 (d)), bounded memory, and bad
input through the CLI (one line on stderr, exit code 2)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from fermijit.model import convert, vision
from fermijit.model.config import load_config
from fermijit.model.reference import Reference
from fermijit.model.safetensors_io import Checkpoint, SafetensorsFile, save_file
from fermijit.model.weights import QuantTensor, assemble, plan_text_weights
from fermijit.ops import quant
from tests.model import tiny
from tests.cli import run_cli


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Split experts, BF16 with an F32 A_log, three shards: the most rewriting the converter does."""
    root = tmp_path_factory.mktemp("convert")
    src = tiny.write_checkpoint(root / "src", "split", "BF16", n_shards=3)
    convert.convert(src, root / "dst", show_progress=False)
    return src, root / "dst"


# Issue 12, item 7: streamed in chunks of 16 rows of the tiny model's 64 columns (fp32), every
# tensor of more than 16 rows is written in several pieces (the embedding and LM head in 20, an
# expert's gate_up in 8), as the real model's are.
SMALL_CHUNK = 16 * 64 * 4


@pytest.fixture(scope="module")
def chunked(converted, tmp_path_factory):
    src, _ = converted
    dst = tmp_path_factory.mktemp("chunked") / "dst"
    convert.convert(src, dst, show_progress=False, chunk_bytes=SMALL_CHUNK)
    return src, dst


def test_stored_values_are_the_quantisation_of_the_source(converted):
    """Every stored byte equals the numpy reference quantiser (GGML-exact) applied to the source."""
    assert_stored_bytes_are_the_quantisation(*converted)


def test_chunked_conversion_stores_the_same_bytes(chunked):
    """Streamed in many chunks, each tensor is still the whole tensor's quantisation, byte for
    byte: no chunk lands at a wrong offset, none is cut mid-row or mid-block."""
    src, dst = chunked
    plans = plan_text_weights(load_config(src).text_config, Checkpoint(src))
    rows = {name: int(np.prod(p.shape[:-1])) for name, p in plans.items()}
    assert rows["embed_tokens"] == rows["lm_head"] == 320 and 320 * 64 * 4 > 10 * SMALL_CHUNK
    assert_stored_bytes_are_the_quantisation(src, dst)


def assert_stored_bytes_are_the_quantisation(src, dst):
    ckpt = Checkpoint(src)
    stored = safetensors.numpy.load_file(dst / convert.WEIGHTS)  # read by the package, not by us
    manifest = json.loads((dst / convert.MANIFEST).read_text())
    cfg = load_config(src)
    plans = {**plan_text_weights(cfg.text_config, ckpt), **vision.plan_weights(cfg, ckpt)}
    assert any(name.startswith("visual.") for name in plans)  # the tower is kept
    assert set(manifest["tensors"]) == set(plans)
    seen = set()
    for name, plan in plans.items():
        x = plan.read_all(ckpt)
        kind = manifest["tensors"][name]["quant"]
        assert kind == convert.quantisation(name, "q8_0")
        if kind in ("f32", "f16"):
            np.testing.assert_array_equal(stored[name], x.astype(kind.replace("f", "float")), name)
            assert stored[name].dtype == kind.replace("f", "float"), name
            seen.add(name)
            continue
        qs, d = (quant.quantize_q4_0 if kind == "q4_0" else quant.quantize_q8_0)(x)
        np.testing.assert_array_equal(stored[name + ".qs"], qs, name)
        np.testing.assert_array_equal(stored[name + ".d"].view(np.uint16), d.view(np.uint16), name)
        seen |= {name + ".qs", name + ".d"}
    assert seen == set(stored)
    kinds = {name: e["quant"] for name, e in manifest["tensors"].items()}
    assert kinds["layers.0.mlp.experts_gate_up"] == "q4_0" and kinds["lm_head"] == "q8_0"
    assert kinds["layers.0.mlp.gate"] == "f32" and kinds["layers.0.linear_attn.A_log"] == "f32"
    assert kinds["embed_tokens"] == "f16"
    assert kinds["visual.blocks.0.attn.qkv.weight"] == "f16"
    assert kinds["visual.blocks.0.attn.qkv.bias"] == kinds["visual.merger.norm.weight"] == "f32"


def test_layout_of_the_file(converted):
    src, dst = converted
    f = SafetensorsFile(dst / convert.WEIGHTS)
    qs = [info for info in f.tensors.values() if info.name.endswith(".qs")]
    assert all((f.data_start + info.begin) % 16 == 0 for info in qs), "qs not 16-byte aligned"
    gate_up = f.tensors["layers.0.mlp.experts_gate_up.qs"]
    assert gate_up.shape == (8, 64, 32) and gate_up.dtype == "U8"  # [E, 2I, H/2], one block
    assert f.tensors["layers.0.mlp.experts_gate_up.d"].shape == (8, 64, 2)
    for name in ("config.json", "generation_config.json"):
        assert (dst / name).read_bytes() == (src / name).read_bytes()
    manifest = json.loads((dst / convert.MANIFEST).read_text())
    assert manifest["format_version"] == convert.FORMAT_VERSION and manifest["reap"] is None
    assert manifest["source"]["fingerprint"] == convert.source_fingerprint(src, Checkpoint(src))


def test_fingerprint_follows_the_source(tmp_path):
    a = tiny.write_checkpoint(tmp_path / "a", "fused", "F32")
    b = tiny.write_checkpoint(tmp_path / "b", "fused", "BF16")
    fa = convert.source_fingerprint(a, Checkpoint(a))
    assert fa != convert.source_fingerprint(b, Checkpoint(b))
    assert fa == convert.source_fingerprint(a, Checkpoint(a))


def test_loader_and_both_layouts_agree(converted, tmp_path):
    """The loaded model is the stored bytes (memmap views), and fused/split sources convert alike;
    the reference forward runs on it (its logits are the 4-bit model's spec)."""
    _, dst = converted
    fused = tiny.write_checkpoint(tmp_path / "fused", "fused", "BF16")
    convert.convert(fused, tmp_path / "fused-out", lm_head="q4_0", show_progress=False)
    cfg, w, _ = convert.load_converted(dst)
    _, w4, manifest = convert.load_converted(tmp_path / "fused-out")
    assert manifest.tensors["lm_head"].quant == "q4_0" and w4.lm_head.kind == "q4_0"
    gate_up, gate_up4 = w.layers[1].mlp.experts_gate_up, w4.layers[1].mlp.experts_gate_up
    assert isinstance(gate_up, QuantTensor) and isinstance(gate_up.qs, np.memmap)
    np.testing.assert_array_equal(gate_up.qs, gate_up4.qs)
    np.testing.assert_array_equal(w.layers[2].mixer.conv1d, w4.layers[2].mixer.conv1d)
    # The loaded model is the source quantised: the reference forward over it gives the logits of
    # the reference forward over the source's tensors quantised and dequantised here.
    src = converted[0]
    ckpt = Checkpoint(src)
    quantised = {}
    for name, plan in plan_text_weights(cfg.text_config, ckpt).items():
        x, kind = plan.read_all(ckpt), convert.quantisation(name, "q8_0")
        if kind == "q4_0":
            x = quant.dequantize_q4_0(*quant.quantize_q4_0(x))
        elif kind == "q8_0":
            x = quant.dequantize_q8_0(*quant.quantize_q8_0(x))
        quantised[name] = x.astype(np.float16) if kind == "f16" else x
    expected = Reference(cfg.text_config, assemble(cfg.text_config, quantised))
    model = Reference(cfg.text_config, w)
    tokens = [5, 17, 200, 33, 9]
    np.testing.assert_array_equal(model.forward(tokens, model.new_state()),
                                  expected.forward(tokens, expected.new_state()))


def test_peak_memory_is_bounded_by_the_chunk(tmp_path):
    """Streaming in 16 KiB chunks, the peak of all Python allocation stays below half of the
    largest tensor (experts with I=512: [8, 1024, 64] fp32 = 2 MiB): none is ever whole."""
    w = tiny.random_weights()
    config = tiny.config_dict()
    config["text_config"] = {**config["text_config"], "moe_intermediate_size": 512}
    rng = np.random.default_rng(0)
    for i in range(4):
        m = f"model.language_model.layers.{i}.mlp.experts."
        w[m + "gate_up_proj"] = rng.standard_normal((8, 1024, 64), dtype=np.float32)
        w[m + "down_proj"] = rng.standard_normal((8, 64, 512), dtype=np.float32)
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    save_file(src / "model.safetensors", w, bf16=frozenset(w))
    largest = 8 * 1024 * 64 * 4
    convert.convert(src, tmp_path / "warm", show_progress=False)  # imports, Numba compile
    tracemalloc.start()
    try:
        convert.convert(src, tmp_path / "dst", show_progress=False, chunk_bytes=16 << 10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < largest / 2, f"peak {peak} B"


def bad_source(tmp_path, case):
    src = tiny.write_checkpoint(tmp_path / "src", "fused", "F32")
    if case == "missing-dir":
        return tmp_path / "nowhere"
    if case == "missing-config":
        (src / "config.json").unlink()
    elif case == "unsupported-type":
        (src / "config.json").write_text(json.dumps({"model_type": "qwen3_next"}))
    elif case == "missing-tensor":
        w = tiny.random_weights()
        del w["model.language_model.layers.1.linear_attn.dt_bias"]
        save_file(src / "model.safetensors", w)
    elif case == "truncated":
        data = (src / "model.safetensors").read_bytes()
        (src / "model.safetensors").write_bytes(data[:len(data) // 2])
    return src


@pytest.mark.parametrize("case, message", [
    ("missing-dir", "no such model directory"),
    ("missing-config", "no config file"),
    ("unsupported-type", "unsupported model_type 'qwen3_next'"),
    ("missing-tensor", "missing tensor model.language_model.layers.1.linear_attn.dt_bias"),
    ("truncated", "corrupt safetensors file"),
])
def test_bad_input_through_the_cli(tmp_path, monkeypatch, capsys, case, message):
    src = bad_source(tmp_path, case)
    code, _, err = run_cli(monkeypatch, capsys, "convert", src, tmp_path / "dst")
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("Error: ") and message in err, err
    assert not (tmp_path / "dst" / convert.MANIFEST).exists()


def test_cli_converts_and_refuses_to_overwrite(tmp_path, monkeypatch, capsys):
    src = tiny.write_checkpoint(tmp_path / "src", "fused", "F16")
    code, _, err = run_cli(monkeypatch, capsys, "convert", src, tmp_path / "dst", "--lm-head", "q4_0")
    assert code == 0, err
    assert "wrote" in err and convert.is_fermijit_model(tmp_path / "dst")
    code, _, err = run_cli(monkeypatch, capsys, "convert", src, tmp_path / "dst")
    assert code == 2 and "exists and is not empty" in err and err.count("\n") == 1
    code, _, err = run_cli(monkeypatch, capsys, "convert", src, tmp_path / "x", "--lm-head", "f16")
    assert code == 2 and "f16" in err
    # Q6_K's rows are 256-blocks: the tiny model's 64 are refused before anything is written
    code, _, err = run_cli(monkeypatch, capsys, "convert", src, tmp_path / "y", "--lm-head", "q6_k")
    assert code == 2 and err.count("\n") == 1 and "lm_head" in err and "multiple of 256" in err
    assert not (tmp_path / "y").exists()


# --- issue 11: faults while converting ---------------------------------------------------------

def one_error_line(err: str) -> bool:
    """The error is stderr's last line and its only one (the progress bar may precede it)."""
    lines = err.splitlines()
    return [x for x in lines if x.startswith("Error")] == lines[-1:] and "Traceback" not in err

def test_non_finite_source_is_refused(tmp_path, monkeypatch, capsys):
    """Case 1: a NaN weight converted silently and ran to exit 0 with changed output."""
    src = tiny.write_checkpoint(tmp_path / "src", "fused", "F32")
    w = tiny.random_weights()
    w["model.language_model.layers.2.mlp.experts.down_proj"][3, 5, 7] = np.inf
    save_file(src / "model.safetensors", w)
    code, _, err = run_cli(monkeypatch, capsys, "convert", src, tmp_path / "dst")
    assert code == 2 and one_error_line(err)
    assert "layers.2.mlp.experts_down holds NaN or infinite values" in err, err
    assert not (tmp_path / "dst").exists()


def test_disk_full_leaves_nothing(tmp_path, monkeypatch, capsys):
    """Case 8: ENOSPC was a traceback, and the .partial file kept holding the space."""
    import errno

    from fermijit.model import safetensors_io

    src = tiny.write_checkpoint(tmp_path / "src", "fused", "F32")
    real_write, calls = safetensors_io.SafetensorsWriter.write, []

    def write(self, name, array, start=0):
        calls.append(name)
        if len(calls) == 20:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return real_write(self, name, array, start)

    monkeypatch.setattr(safetensors_io.SafetensorsWriter, "write", write)
    code, _, err = run_cli(monkeypatch, capsys, "convert", src, tmp_path / "dst")
    assert code == 2 and one_error_line(err), err
    assert "No space left on device" in err and "model.safetensors.partial" in err
    assert not (tmp_path / "dst").exists()
    (tmp_path / "empty").mkdir()  # a directory the user made stays, emptied
    calls.clear()
    code, _, err = run_cli(monkeypatch, capsys, "convert", src, tmp_path / "empty")
    assert code == 2 and list((tmp_path / "empty").iterdir()) == []


def test_sigterm_removes_the_partial_output(tmp_path):
    """Case 8: SIGTERM mid-convert left model.safetensors.partial behind."""
    src = tiny.write_checkpoint(tmp_path / "src", "fused", "F32")
    code = textwrap.dedent(f"""
        import os, signal, sys
        from fermijit.model import convert
        from fermijit.cli import main
        real = convert.stream
        def stream(*args):
            for i, n in enumerate(real(*args)):
                if args[0] == "layers.1.mlp.experts_gate_up":
                    os.kill(os.getpid(), signal.SIGTERM)
                yield n
        convert.stream = stream
        sys.argv = ["fermijit", "convert", {str(src)!r}, {str(tmp_path / "dst")!r}]
        main()
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines()[-1] == "Error: convert: terminated (SIGTERM)", r.stderr
    assert not (tmp_path / "dst").exists()


def test_leftovers_are_named(tmp_path, monkeypatch, capsys):
    """A convert killed by SIGKILL leaves its .partial: the next one says what it is."""
    src = tiny.write_checkpoint(tmp_path / "src", "fused", "F32")
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "model.safetensors.partial").write_bytes(b"x")
    code, _, err = run_cli(monkeypatch, capsys, "convert", src, tmp_path / "dst")
    assert code == 2 and "it holds model.safetensors.partial, left by a convert" in err


@pytest.mark.parametrize("case, message", [
    ("under-a-file", "Not a directory"),
    ("unwritable-parent", "cannot create the output directory"),
    ("corrupt-tokenizer", "tokenizer.json: not a readable tokenizer"),
])
def test_destination_and_tokenizer_faults(tmp_path, monkeypatch, capsys, case, message):
    """Cases 8 and 14: NotADirectoryError, PermissionError; a corrupt tokenizer copied silently."""
    src = tiny.write_checkpoint(tmp_path / "src", "fused", "F32")
    dst = tmp_path / "dst"
    if case == "under-a-file":
        (tmp_path / "file").write_text("x")
        dst = tmp_path / "file" / "dst"
    elif case == "unwritable-parent":
        dst = Path("/proc/fermijit-test/dst")  # not creatable, even by root
    else:
        (src / "tokenizer.json").write_text('{"model": {"type": "nonsense"}}')
    code, _, err = run_cli(monkeypatch, capsys, "convert", src, dst)
    assert code == 2 and one_error_line(err) and message in err, err


def test_missing_tokenizer_is_said(tmp_path, monkeypatch, capsys):
    src = tiny.write_checkpoint(tmp_path / "src", "fused", "F32")
    (src / "tokenizer.json").unlink()
    code, _, err = run_cli(monkeypatch, capsys, "convert", src, tmp_path / "dst")
    assert code == 0 and "has no tokenizer.json" in err



@pytest.mark.parametrize("fits", [True, False])
def test_weights_are_faulted_in_at_load_when_they_fit(converted, monkeypatch, fits):
    # A file too large for memory is left to fault on use (its pages would be evicted as read).
    populated = []
    monkeypatch.setattr(SafetensorsFile, "populate",
                        lambda self, background=False: populated.append(self.path))
    if not fits:
        monkeypatch.setattr(convert, "available_nbytes", lambda: 1 << 16)
    convert.load_converted(converted[1])
    assert len(populated) == fits
