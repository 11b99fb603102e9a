"""Our safetensors reader and writer, against the `safetensors` package and against bad files."""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from fermijit import FermijitError
from fermijit.machine import mapping_bytes
from fermijit.model import safetensors_io
from fermijit.model.safetensors_io import (Checkpoint, SafetensorsFile, SafetensorsWriter,
                                           bf16_to_f32, f32_to_bf16, save_file)


def sample(rng) -> dict[str, np.ndarray]:
    return {"w": rng.standard_normal((5, 7), dtype=np.float32),
            "h": rng.standard_normal(9).astype(np.float16),
            "q": rng.integers(0, 256, (3, 16), dtype=np.uint8),
            "i": rng.integers(-128, 128, 33, dtype=np.int8),
            "empty": np.zeros((0, 4), np.float32)}


def test_reads_files_the_package_writes(tmp_path, rng):
    tensors = sample(rng)
    safetensors.numpy.save_file(tensors, tmp_path / "a.safetensors", metadata={"format": "np"})
    f = SafetensorsFile(tmp_path / "a.safetensors")
    assert f.metadata == {"format": "np"}
    for name, a in tensors.items():
        got = f.raw(name)
        assert got.dtype == a.dtype and not got.flags.writeable
        np.testing.assert_array_equal(got, a)


def test_package_reads_files_we_write(tmp_path, rng):
    tensors = sample(rng)
    save_file(tmp_path / "b.safetensors", tensors, metadata={"k": "v"})
    back = safetensors.numpy.load_file(tmp_path / "b.safetensors")
    for name, a in tensors.items():
        np.testing.assert_array_equal(back[name], a)
    # Data starts 64-byte aligned, so 16-byte-multiple tensors placed first stay aligned.
    assert SafetensorsFile(tmp_path / "b.safetensors").data_start % 64 == 0


def test_bf16_round_trip_is_exact_shift(tmp_path, rng):
    x = rng.standard_normal(1000, dtype=np.float32) * 1e3
    bits = f32_to_bf16(x)
    back = bf16_to_f32(bits)
    assert np.array_equal(back.view(np.uint32) & 0xFFFF, np.zeros(1000, np.uint32))
    assert np.max(np.abs(back - x) / np.abs(x)) <= 2.0 ** -8  # round to nearest: half an ulp
    save_file(tmp_path / "model.safetensors", {"x": x}, bf16=frozenset({"x"}))
    np.testing.assert_array_equal(Checkpoint(tmp_path).float32("x"), back)
    torch = pytest.importorskip("torch")
    expect = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bits, expect)  # same rounding as torch


def test_writer_in_pieces_and_out_of_order(tmp_path):
    specs = [("a", "F32", (4, 3)), ("b", "U8", (5,))]
    with SafetensorsWriter(tmp_path / "p.safetensors", specs) as w:
        w.write("b", np.arange(5, dtype=np.uint8))
        w.write("a", np.ones((2, 3), np.float32), start=6)
        w.write("a", np.zeros((2, 3), np.float32), start=0)
    a = SafetensorsFile(tmp_path / "p.safetensors").raw("a")
    np.testing.assert_array_equal(a, np.repeat([[0.0], [1.0]], 2, axis=0) * np.ones((4, 3)))


@pytest.mark.parametrize("mistake, message", [
    ("missing", "tensor a was not written exactly once"),
    ("twice", "tensor a was not written exactly once"),
    ("dtype", "a is F32, got a float64 array"),
    ("past-end", "write past the end of a"),
])
def test_writer_rejects_mistakes(tmp_path, mistake, message):
    w = SafetensorsWriter(tmp_path / "p.safetensors", [("a", "F32", (2, 3))])
    with pytest.raises(FermijitError, match=message):
        if mistake == "missing":
            w.write("a", np.ones(3, np.float32))
        elif mistake == "twice":
            w.write("a", np.ones(3, np.float32))
            w.write("a", np.ones(3, np.float32))
        elif mistake == "dtype":
            w.write("a", np.ones(6, np.float64))
        else:
            w.write("a", np.ones(6, np.float32), start=1)
        w.close()


def sharded(tmp_path, rng, n=3):
    tensors = {f"t{i}": rng.standard_normal((i + 1, 2), dtype=np.float32) for i in range(7)}
    names = sorted(tensors)
    weight_map = {}
    for k in range(n):
        file = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        save_file(tmp_path / file, {name: tensors[name] for name in names[k::n]})
        weight_map.update({name: file for name in names[k::n]})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tensors


def test_sharded_checkpoint(tmp_path, rng):
    tensors = sharded(tmp_path, rng)
    ck = Checkpoint(tmp_path)
    assert sorted(ck.names()) == sorted(tensors)
    for name, a in tensors.items():
        np.testing.assert_array_equal(ck.float32(name), a)
        np.testing.assert_array_equal(ck.float32(name, (slice(1, None),)), a[1:])


def header_file(path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize("case, message", [
    ("short", "shorter than the 8-byte header length"),
    ("huge-header", "header length"),
    ("not-json", "header: not valid JSON"),
    ("not-object", "header is not a JSON object"),
    ("bad-entry", "bad header entry for 'a'"),
    ("bad-dtype", "bad header entry for 'a'"),
    ("wrong-size", "do not hold F32"),
    ("truncated", "truncated"),
    # issue 11 case 1: aliased bytes, duplicate names; case 3: hostile JSON; case 9: big shapes
    ("overlap", "b \\(bytes 0-16\\) overlaps a"),
    ("partial-overlap", "b \\(bytes 8-24\\) overlaps a"),
    ("duplicate-key", "the key 'a' appears twice"),
    ("nan-literal", "NaN is not a number JSON allows"),
    ("deep", "nested"),
    ("huge-int", "an integer of 5000 digits"),
    ("shape-over-2^63", "bad header entry for 'a'"),
    ("shape-wraps-2^64", "do not hold F32"),
])
def test_corrupt_file_is_named(tmp_path, case, message):
    path = tmp_path / "model.safetensors"
    entry = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    if case == "short":
        path.write_bytes(b"\x01\x02")
    elif case == "huge-header":
        path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    elif case == "not-json":
        header_file(path, b"{nope")
    elif case == "not-object":
        header_file(path, b"[1, 2]")
    elif case == "bad-entry":
        header_file(path, json.dumps({"a": {"dtype": "F32", "shape": [2]}}).encode(), bytes(8))
    elif case == "bad-dtype":
        header_file(path, json.dumps({"a": {**entry, "dtype": "F8"}}).encode(), bytes(16))
    elif case == "wrong-size":
        header_file(path, json.dumps({"a": {**entry, "data_offsets": [0, 12]}}).encode(),
                    bytes(16))
    elif case in ("overlap", "partial-overlap"):
        begin = 0 if case == "overlap" else 8
        b = {**entry, "data_offsets": [begin, begin + 16]}
        header_file(path, json.dumps({"a": entry, "b": b}).encode(), bytes(32))
    elif case == "duplicate-key":
        header_file(path, b'{"a": %s, "a": %s}' % ((json.dumps(entry).encode(),) * 2), bytes(16))
    elif case == "nan-literal":
        header_file(path, b'{"__metadata__": {"x": NaN}}')
    elif case == "deep":
        header_file(path, b"[" * 100000 + b"]" * 100000)
    elif case == "huge-int":
        header_file(path, b'{"a": {"dtype": "F32", "shape": [%s]}}' % (b"9" * 5000))
    elif case == "shape-over-2^63":
        header_file(path, json.dumps({"a": {**entry, "shape": [2 ** 63, 0]}}).encode())
    elif case == "shape-wraps-2^64":  # 2**62 * 4 elements of 4 bytes wrapped to 0 in int64
        header_file(path, json.dumps({"a": {**entry, "shape": [2 ** 31, 2 ** 31],
                                            "data_offsets": [0, 0]}}).encode())
    else:
        header_file(path, json.dumps({"a": entry}).encode(), bytes(10))
    with pytest.raises(FermijitError, match=message) as e:
        Checkpoint(tmp_path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_bad_directories(tmp_path, rng):
    with pytest.raises(FermijitError, match="no such model directory"):
        Checkpoint(tmp_path / "nope")
    with pytest.raises(FermijitError, match="no model.safetensors or"):
        Checkpoint(tmp_path)
    sharded(tmp_path, rng)
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FermijitError, match="model-00002-of-00003.safetensors: shard named"):
        Checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(FermijitError, match="not a safetensors index"):
        Checkpoint(tmp_path)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/x", ".."])
def test_index_names_only_bare_files(tmp_path, shard):
    """Issue 11 case 13: a shard name leading out of the directory is refused before any open."""
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": shard}}))
    with pytest.raises(FermijitError, match="is not a bare file name") as e:
        Checkpoint(tmp_path)
    assert "root:" not in str(e.value)


def test_a_fifo_is_not_opened(tmp_path):
    """Issue 11 case 12: a FIFO in place of a weights file would block for ever."""
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(FermijitError, match="not a regular file"):
        Checkpoint(tmp_path)


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc")
def test_populate_maps_every_page(tmp_path, rng):
    save_file(tmp_path / "w.safetensors", {"w": rng.standard_normal(1 << 22).astype(np.float32)})
    lazy, eager = (SafetensorsFile(tmp_path / "w.safetensors") for _ in range(2))
    size = lazy.data_nbytes
    assert mapping_bytes(lazy.mapped().ctypes.data, "Rss") < size // 4  # nothing read yet
    if not eager.populate():
        pytest.skip("this kernel has no MADV_POPULATE_READ (Linux < 5.14)")
    assert mapping_bytes(eager.mapped().ctypes.data, "Rss") >= size
    np.testing.assert_array_equal(eager.raw("w"), lazy.raw("w"))


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc")
def test_populate_after_holds_the_background_populate(tmp_path, rng, monkeypatch):
    """Inside safetensors_io.populate_after (serve's load and warm-up), a background populate
    begins only when the block ends (never where it raised); with FERMIJIT_POPULATE_AFTER=0, at
    once."""
    save_file(tmp_path / "w.safetensors", {"w": rng.standard_normal(1 << 22).astype(np.float32)})
    started = []
    real = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self.name),
                                                                  real(self))[1])
    for env, before_end in (("1", []), ("0", ["fermijit-populate"])):
        monkeypatch.setenv(safetensors_io.POPULATE_AFTER_ENV, env)
        started.clear()
        with safetensors_io.populate_after():
            assert SafetensorsFile(tmp_path / "w.safetensors").populate(background=True)
            assert started == before_end
        assert started == ["fermijit-populate"]
    monkeypatch.setenv(safetensors_io.POPULATE_AFTER_ENV, "1")
    started.clear()
    with pytest.raises(FermijitError), safetensors_io.populate_after():  # a failed start
        SafetensorsFile(tmp_path / "w.safetensors").populate(background=True)
        raise FermijitError("the load failed")
    assert started == []
