"""Hostile GGUF files (issue 30 items 6 and 9): two tensor names on the same bytes, offsets off
the file's alignment, Inf/NaN block scales. Each converted (and generated, and passed `verify`)
with rc 0 and garbage; now `convert` and `generate --model x.gguf` are one line and exit 2, and
the sound file still converts to what it did."""

from __future__ import annotations

import shutil
import struct

import numpy as np
import pytest

from fermijit.model.gguf_io import GgufFile
from tests.cli import run_cli
from tests.fermijit.test_hardening import assert_one_line
from tests.model import gguf_data


def _offset_field(g: GgufFile, name: str) -> int:
    """Where tensor `name`'s data offset (u64) sits in the file: its info is the name (u64
    length, bytes), n_dims (u32), the dims (u64 each), the type (u32), then the offset."""
    t = g.tensors[name]
    return t.field.offset + 8 + len(name.encode()) + 4 + 8 * len(t.shape) + 4


def _set_offset(path, name: str, relative: int) -> None:
    at = _offset_field(GgufFile(path), name)
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(struct.pack("<Q", relative))


def overlapping(path):
    """blk.0.attn_norm.weight on output_norm.weight's bytes (both F32 [64])."""
    g = GgufFile(path)
    other = g.tensors["output_norm.weight"]
    _set_offset(path, "blk.0.attn_norm.weight", other.data_offset - g.reader.data_offset)


def misaligned(path):
    """The last tensor 4 bytes back: inside the file, off the 32-byte alignment."""
    g = GgufFile(path)
    last = max(g.reader.tensors, key=lambda t: t.data_offset)
    _set_offset(path, last.name, last.data_offset - g.reader.data_offset - 4)


def non_finite_scale(value: float):
    def change(path):
        t = GgufFile(path).tensors["output.weight"]  # Q8_0: fp16 scale, then 32 quants
        with open(path, "r+b") as f:
            f.seek(t.data_offset + 34 * 5)
            f.write(np.float16(value).tobytes())
    return change


CASES = {"overlapping tensors": (overlapping, "has offset"),
         "a misaligned offset": (misaligned, "has offset"),
         "an infinite scale": (non_finite_scale(np.inf), "NaN or infinite block scales"),
         "a NaN scale": (non_finite_scale(np.nan), "NaN or infinite block scales")}


GENERATE = ("hi", "--max-tokens", "4", "--temperature", "0", "--threads", "1")


@pytest.fixture(scope="module")
def answer(tmp_path_factory):
    """What the sound file answers, from a process of its own, before any hostile one."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "FERMIJIT_CACHE": str(tmp_path_factory.mktemp("sound-cache"))}
    r = subprocess.run([sys.executable, "-m", "fermijit", "generate", "--model",
                        str(gguf_data.Q8_0), *GENERATE], capture_output=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    return r.stdout.decode()


@pytest.fixture
def hostile(tmp_path, request):
    path = tmp_path / "hostile.gguf"
    shutil.copyfile(gguf_data.Q8_0, path)
    change, message = CASES[request.param]
    change(path)
    return path, message


@pytest.mark.parametrize("hostile", CASES, indirect=True)
@pytest.mark.parametrize("verb", ["convert", "generate"])
def test_a_hostile_gguf_is_one_line(hostile, verb, tmp_path, monkeypatch, capsys, answer):
    monkeypatch.setenv("FERMIJIT_CACHE", str(tmp_path / "cache"))
    path, message = hostile
    args = (["convert", path, tmp_path / "out"] if verb == "convert"
            else ["generate", "--model", path, *GENERATE])
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert_one_line(code, err, message)
    assert not (tmp_path / "out").exists()
    assert not list((tmp_path / "cache").rglob("fermijit.json"))  # no conversion kept
    code, out, err = run_cli(monkeypatch, capsys, "generate", "--model", gguf_data.Q8_0,
                             *GENERATE)
    assert code == 0 and out == answer, err


def test_the_sound_file_still_converts(tmp_path, monkeypatch, capsys):
    """The checks refuse what llama.cpp's loader refuses, nothing llama.cpp itself writes."""
    for path in (gguf_data.Q4_0, gguf_data.Q8_0, gguf_data.F32):
        code, _, err = run_cli(monkeypatch, capsys, "convert", path, tmp_path / path.stem)
        assert code == 0, err
