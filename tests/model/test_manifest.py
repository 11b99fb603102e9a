"""fermijit.json (model/manifest.py): typed, every bad field named; checksums written by
convert.write_manifest, the smallest tensors checked at load, all by `verify` (issue 11 cases 1,
4, 12, 13)."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from fermijit import FermijitError, cli
from fermijit.engine import DEFAULT_MODEL
from fermijit.model import convert, manifest
from fermijit.model.safetensors_io import SafetensorsFile
from tests.model import tiny
from tests.cli import run_cli


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("manifest")
    src = tiny.write_checkpoint(root / "src", "fused", "F32")
    convert.convert(src, root / "q4", show_progress=False)
    return root / "q4"


@pytest.fixture
def copy(model, tmp_path):
    shutil.copytree(model, tmp_path / "m")
    return tmp_path / "m"


def edit(directory, change) -> None:
    path = directory / manifest.MANIFEST
    raw = json.loads(path.read_text())
    change(raw)
    path.write_text(json.dumps(raw))


def entry(raw, name="layers.0.input_layernorm"):
    return raw["tensors"][name]


BAD_MANIFESTS = {
    "entry-is-a-string": (lambda r: r["tensors"].update(norm="q4"),
                          "tensors: norm: expected an object, got 'q4'"),
    "shape-is-a-number": (lambda r: entry(r).update(shape=64), "shape: expected tuple[int, ...]"),
    "tensors-is-a-list": (lambda r: r.update(tensors=[]), "tensors: expected dict"),
    "weights-null": (lambda r: r.update(weights=None), "weights: expected str, got null"),
    "weights-number": (lambda r: r.update(weights=3), "weights: expected str, got 3"),
    "missing-quant": (lambda r: entry(r).pop("quant"), "missing required field 'quant'"),
    "unknown-quant": (lambda r: entry(r).update(quant="q2_k"),
                      "quant: expected one of q4_0, q8_0, f16, f32, q4_k, q5_k, q6_k, q5_0, "
                      "q5_1, got 'q2_k'"),
    "version-string": (lambda r: r.update(format_version="1"),
                       "format_version: expected int, got '1'"),
    "version-1": (lambda r: r.update(format_version=1), "format version 1, this fermijit reads 2"),
    "unknown-field": (lambda r: r.update(extra=1), "unknown field 'extra'"),
    "bad-checksum": (lambda r: entry(r).update(checksum="xyz"), "checksum is not a sha256"),
    "weights-parent": (lambda r: r.update(weights="../model.safetensors"), "not a bare file name"),
    "weights-absolute": (lambda r: r.update(weights="/etc/passwd"), "not a bare file name"),
    "zero-dim": (lambda r: entry(r).update(shape=[0]), "shape [0] is not"),
    "extra-tensor": (lambda r: r["tensors"].update(x=entry(r)), "tensor x is not in a model"),
}


@pytest.mark.parametrize("case", BAD_MANIFESTS)
def test_bad_manifest_names_the_field(copy, case):
    change, message = BAD_MANIFESTS[case]
    edit(copy, change)
    with pytest.raises(FermijitError, match=message.replace("[", r"\[").replace("(", r"\(")) as e:
        convert.load_converted(copy)
    assert "\n" not in str(e.value) and "root:" not in str(e.value)


def test_weights_naming_a_fifo_does_not_block(copy):
    os.mkfifo(copy / "pipe")
    edit(copy, lambda r: r.update(weights="pipe"))
    with pytest.raises(FermijitError, match="not a regular file"):
        convert.load_converted(copy)


def flip(directory, stored: str, value=None, offset: int = 0) -> None:
    """One byte of stored tensor `stored` flipped, `offset` bytes in (or its first fp16/fp32
    element set)."""
    path = directory / convert.WEIGHTS
    f = SafetensorsFile(path)
    info = f.tensors[stored]
    at = f.data_start + info.begin + offset
    with open(path, "r+b") as fh:
        fh.seek(at)
        if value is None:
            byte = fh.read(1)
            fh.seek(at)
            fh.write(bytes([byte[0] ^ 0x10]))
        else:
            fh.write(np.array([value], {"F16": np.float16, "F32": np.float32}[info.dtype])
                     .tobytes())


def test_checksums_are_of_the_stored_bytes(model):
    m = manifest.read_manifest(model)
    weights = SafetensorsFile(model / m.weights)
    for name, e in m.tensors.items():
        assert manifest.checksum(weights, name, e) == e.checksum, name
    assert len({e.checksum for e in m.tensors.values()}) > len(m.tensors) // 2


def test_load_checks_the_small_tensors(copy):
    flip(copy, "layers.1.input_layernorm", value=np.nan)
    with pytest.raises(FermijitError, match="tensor layers.1.input_layernorm does not match"):
        convert.load_converted(copy)


def test_verify_finds_a_flipped_byte_in_a_big_tensor(tmp_path, monkeypatch, capsys):
    copy = tmp_path / "default"  # experts large enough to be sampled in chunks
    shutil.copytree(DEFAULT_MODEL, copy)
    code, out, err = run_cli(monkeypatch, capsys, "verify", "--model", copy)
    assert code == 0 and "all match their checksums" in out, err
    entry = manifest.read_manifest(copy).tensors["layers.2.mlp.experts_gate_up"]
    nbytes = SafetensorsFile(copy / convert.WEIGHTS).tensors["layers.2.mlp.experts_gate_up.qs"]
    spans = manifest.sample_spans(nbytes.end - nbytes.begin, entry.shape[0])
    assert len(spans) > 1, "the tensor is sampled whole: no byte escapes the load check"
    flip(copy, "layers.2.mlp.experts_gate_up.qs", offset=spans[1][0] - 1)  # between two chunks
    monkeypatch.setattr(manifest, "LOAD_CHECK_NBYTES", 0)  # as for a big model: sampled only
    convert.load_converted(copy)
    code, out, err = run_cli(monkeypatch, capsys, "verify", "--model", copy)
    assert code == 2 and out == ""
    assert err.splitlines()[-1].startswith("Error: ") and \
        "tensor layers.2.mlp.experts_gate_up does not match its checksum" in err


def test_load_finds_a_flipped_byte_in_a_sampled_chunk(copy, monkeypatch):
    flip(copy, "layers.2.mlp.experts_gate_up.qs")  # its first byte: in the first chunk
    monkeypatch.setattr(manifest, "LOAD_CHECK_NBYTES", 0)
    with pytest.raises(FermijitError, match="experts_gate_up does not match its sampled"):
        convert.load_converted(copy)


def test_verify_finds_a_nan_scale(copy, monkeypatch, capsys):
    """A NaN block scale written with a matching checksum (a buggy writer): still refused."""
    flip(copy, "layers.0.mlp.shared_down.d", value=np.inf)
    m = manifest.read_manifest(copy)
    convert.write_manifest(copy, {n: (e.shape, e.quant) for n, e in m.tensors.items()},
                           m.source)
    code, out, err = run_cli(monkeypatch, capsys, "verify", "--model", copy)
    assert code == 2 and "layers.0.mlp.shared_down holds NaN or infinite values" in err


def test_the_default_model_verifies():
    n_tensors, nbytes = manifest.verify(DEFAULT_MODEL, show_progress=False)
    assert n_tensors > 100 and nbytes == (DEFAULT_MODEL / "model.safetensors").stat().st_size \
        - SafetensorsFile(DEFAULT_MODEL / "model.safetensors").data_start


def test_write_manifest_refuses_a_missing_stored_tensor(copy):
    m = manifest.read_manifest(copy)
    tensors = {n: (e.shape, e.quant) for n, e in m.tensors.items()}
    tensors["layers.0.input_layernorm"] = ((64,), "q8_0")
    with pytest.raises(FermijitError, match="no I8 \\[64\\] tensor layers.0.input_layernorm.qs"):
        convert.write_manifest(copy, tensors, m.source)


def test_a_sample_is_the_sha256_of_its_chunks_in_turn(model):
    """manifest.sample hashes its chunks gathered at once (issue 28 item 4: np.memmap slicing per
    chunk cost 0.23 s of a full-size load): the digest of each stored part's sample_spans hashed
    one after the other, as models converted before were written."""
    import hashlib

    m = manifest.read_manifest(model)
    weights = SafetensorsFile(model / m.weights)
    n_chunked = 0
    for name, e in m.tensors.items():
        h = hashlib.sha256()
        for stored, _, _ in manifest.stored_specs(name, e.shape, e.quant):
            raw = weights.raw(stored).reshape(-1).view(np.uint8)
            spans = manifest.sample_spans(raw.size, e.shape[0] if len(e.shape) == 3 else 1)
            n_chunked += len(spans) > 1
            for a, b in spans:
                h.update(raw[a:b].tobytes())
        assert manifest.sample(weights, name, e, check_floats=True) == h.hexdigest(), name
    assert n_chunked > 0


def test_a_load_inside_checks_beside_is_checked_on_leaving_the_block(copy, model):
    """convert.checks_beside (serve: the load's check beside the warm-up, issue 28 item 4): the
    load returns, the check runs on a thread of its own, and leaving the block raises what it
    found, the same FermijitError as a load outside the block; a sound model passes; the block's
    own error wins over the check's, which is still awaited."""
    flip(copy, "layers.1.input_layernorm", value=np.nan)
    with pytest.raises(FermijitError, match="tensor layers.1.input_layernorm does not match"):
        with convert.checks_beside():
            convert.load_converted(copy)  # returns: its check is on a thread
            loaded = True
    assert loaded
    with convert.checks_beside():
        convert.load_converted(model)
    with pytest.raises(KeyError):
        with convert.checks_beside():
            convert.load_converted(copy)
            raise KeyError("the block's own")
    with pytest.raises(FermijitError, match="does not match"):  # outside: at once, as before
        convert.load_converted(copy)
