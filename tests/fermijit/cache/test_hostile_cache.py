"""The snapshot cache directory as untrusted input (issue 30 items 4 and 9): replicas share it, so
anyone who can write there can plant files. Each planted or damaged file is skipped with one
warning line, never hangs, loops or raises, and the prompt then gives the uncached logits; with
`--cache-key` a file not signed with the key is never used."""

from __future__ import annotations

import json
import os
import struct
import threading

import numpy as np
import pytest

from fermijit.cache.prefix_cache import PrefixCache
from fermijit.cache.snapshot_dir import MAGIC, SUFFIX
from fermijit.model.forward import load_model
from tests.fermijit.cache.test_prefix_cache import EVERY, HIT_REL, cached, uncached
from tests.fermijit.cache.test_prefix_cache import models, one_thread  # noqa: F401  (fixtures)
from tests.model.oracle import assert_rel

PROMPT = np.arange(10, 40, dtype=np.int32)  # snapshots at 8, 16, 24 and its end, 30
WATCHDOG_S = 120  # a lookup that takes longer hangs (a FIFO) or loops (a self-parent)


@pytest.fixture(scope="module")
def q4(models):
    return load_model(models["w4a8"])[1]


def open_cache(model, directory, key=None):
    warnings = []
    cache = PrefixCache("model-a", mem_bytes=2 ** 30, directory=directory, snapshot_every=EVERY,
                        check=model.check_state, warn=warnings.append, key=key)
    return cache, warnings


def snapshots(cache):
    """The snapshot files, deepest last."""
    return sorted(cache.disk.dir.glob("*" + SUFFIX), key=lambda p: _header(p)[0]["position"])


def _header(path):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[len(MAGIC):len(MAGIC) + 8])[0]
    start = len(MAGIC) + 8
    return json.loads(data[start:start + n]), data[start + n:]


def _rewrite(path, header=None, raw_header: bytes | None = None, sections: bytes | None = None):
    old, old_sections = _header(path)
    raw = raw_header if raw_header is not None else json.dumps(header or old).encode()
    path.write_bytes(MAGIC + struct.pack("<Q", len(raw)) + raw
                     + (old_sections if sections is None else sections))


def _within_watchdog(fn):
    """fn() on a thread; fails (rather than hanging the suite) past WATCHDOG_S."""
    result = []
    t = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    t.start()
    t.join(WATCHDOG_S)
    assert not t.is_alive(), f"still running after {WATCHDOG_S} s: hung or looping"
    return result[0]


def _written(q4, tmp_path, key=None):
    writer, warnings = open_cache(q4, tmp_path, key)
    cached(q4, writer, PROMPT)
    assert not warnings
    return writer


def _assert_skipped_once(q4, tmp_path, message, key=None, n_warnings=1):
    """A fresh process (an empty memory) resumes PROMPT: the damaged file is skipped with one
    warning naming why, and the logits are the uncached ones."""
    reader, warnings = open_cache(q4, tmp_path, key)
    logits, _ = _within_watchdog(lambda: cached(q4, reader, PROMPT))
    assert len(warnings) == n_warnings and all("skipped" in w for w in warnings), warnings
    assert any(message in w for w in warnings), warnings
    assert all("\n" not in w for w in warnings)
    assert_rel("logits", uncached(q4, PROMPT), logits, HIT_REL)
    return reader, warnings


# --- item 4: what was a hang, a loop or a traceback ---------------------------------------------

def test_a_fifo_named_like_a_snapshot_does_not_hang(q4, tmp_path):
    """`generate` hung for ever on main (and every server reading the directory wedged)."""
    writer = _written(q4, tmp_path)
    os.mkfifo(writer.disk.dir / ("f" * 40 + SUFFIX))
    _assert_skipped_once(q4, tmp_path, "a FIFO")


@pytest.mark.parametrize("kind", ["a directory", "a character device"])
def test_other_non_files_are_skipped(q4, tmp_path, kind):
    writer = _written(q4, tmp_path)
    path = writer.disk.dir / ("d" * 40 + SUFFIX)
    if kind == "a directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    _assert_skipped_once(q4, tmp_path, kind)


def test_a_snapshot_naming_itself_as_its_parent_does_not_loop(q4, tmp_path):
    end = snapshots(_written(q4, tmp_path))[-1]
    header, _ = _header(end)
    header.update(parent=end.name, parent_position=header["position"])
    _rewrite(end, header)
    _assert_skipped_once(q4, tmp_path, "parent")


def test_two_snapshots_naming_each_other_do_not_loop(q4, tmp_path):
    files = snapshots(_written(q4, tmp_path))
    a, b = files[-2], files[-1]
    ha, _ = _header(a)
    ha.update(parent=b.name, parent_position=_header(b)[0]["position"])
    _rewrite(a, ha)
    _assert_skipped_once(q4, tmp_path, "parent", n_warnings=2)


HEADERS = {
    "nested 200000 deep": lambda h: json.dumps(h)[:-1].encode() + b', "x": '
    + b"[" * 200_000 + b"]" * 200_000 + b"}",
    "position Infinity": lambda h: json.dumps({**h, "position": "INF"}).replace(
        '"INF"', "Infinity").encode(),
    "a token out of int32": lambda h: json.dumps({**h, "tokens": h["tokens"][:-1] + [2 ** 40]})
    .encode(),
    "a negative shape": lambda h: json.dumps({**h, "kv": {**h["kv"], "arrays": [
        [-s for s in shape] for shape in h["kv"]["arrays"]]}}).encode(),
    "a shape that overflows": lambda h: json.dumps({**h, "kv": {**h["kv"], "arrays": [
        [2 ** 62, 2 ** 62]] + h["kv"]["arrays"][1:]}}).encode(),
    "position a string": lambda h: json.dumps({**h, "position": "30"}).encode(),
    "layers not a list": lambda h: json.dumps({**h, "layers": 7}).encode(),
    "a parent path": lambda h: json.dumps({**h, "parent": "../../etc/passwd"}).encode(),
    "an offset past the file": lambda h: json.dumps({**h, "state": {**h["state"],
                                                                    "offset": 2 ** 60}}).encode(),
    "a duplicate key": lambda h: json.dumps(h)[:-1].encode() + b', "position": 3}',
    "not an object": lambda h: b"[1, 2, 3]",
}


@pytest.mark.parametrize("change", HEADERS.values(), ids=HEADERS.keys())
def test_a_hostile_header_is_skipped_with_one_warning(q4, tmp_path, change):
    """4 tracebacks on main (deep nesting, Infinity, out of int32, negative shapes); in the
    server every request was a 500 until the file was deleted."""
    end = snapshots(_written(q4, tmp_path))[-1]
    header, _ = _header(end)
    _rewrite(end, raw_header=change(header))
    _assert_skipped_once(q4, tmp_path, end.name)


def test_non_finite_values_with_a_matching_checksum_are_skipped(q4, tmp_path):
    """A NaN state whose CRC was recomputed: used on main (rc 0, other text)."""
    import zlib

    end = snapshots(_written(q4, tmp_path))[-1]
    header, sections = _header(end)
    body = bytearray(sections)
    state = header["state"]
    start = state["offset"]
    body[start:start + 4] = np.float32(np.nan).tobytes()
    state["crc32"] = zlib.crc32(bytes(body[start:start + state["nbytes"]]))
    _rewrite(end, header, sections=bytes(body))
    _assert_skipped_once(q4, tmp_path, "NaN or infinite")


# --- --cache-key: forgery --------------------------------------------------------------------

def test_a_keyed_cache_resumes_from_its_own_snapshots(q4, tmp_path):
    _written(q4, tmp_path, key=b"k1")
    reader, warnings = open_cache(q4, tmp_path, key=b"k1")
    logits, n = cached(q4, reader, PROMPT)
    assert n == PROMPT.size and not warnings
    assert_rel("logits", uncached(q4, PROMPT), logits, HIT_REL)


def test_a_forged_section_is_refused_with_the_key(q4, tmp_path):
    """A state changed and its CRC recomputed passes without a key; with one it cannot."""
    import zlib

    end = snapshots(_written(q4, tmp_path, key=b"k1"))[-1]
    header, sections = _header(end)
    body = bytearray(sections)
    state = header["state"]
    body[state["offset"] + 8] ^= 0x01
    state["crc32"] = zlib.crc32(bytes(body[state["offset"]:state["offset"] + state["nbytes"]]))
    _rewrite(end, header, sections=bytes(body))
    _assert_skipped_once(q4, tmp_path, "--cache-key", key=b"k1")


@pytest.mark.parametrize("writer_key", [None, b"other"])
def test_files_not_signed_with_the_key_are_not_used(q4, tmp_path, writer_key):
    _written(q4, tmp_path, key=writer_key)
    reader, warnings = open_cache(q4, tmp_path, key=b"k1")
    logits, n = cached(q4, reader, PROMPT)
    assert n == 0 and len(warnings) == 4 and all("--cache-key" in w for w in warnings), warnings
    assert_rel("logits", uncached(q4, PROMPT), logits, HIT_REL)


def test_generate_with_a_fifo_in_the_cache_dir(tmp_path):
    """Through the command line, as on main, where it hung: the same text, rc 0, one warning."""
    import subprocess
    import sys

    from fermijit.cache.prefix_cache import model_fingerprint
    from fermijit.engine import DEFAULT_MODEL

    def generate(*flags):
        r = subprocess.run([sys.executable, "-m", "fermijit", "generate", "def f", "--max-tokens",
                            "6", "--temperature", "0", "--threads", "1", *flags],
                           capture_output=True, timeout=WATCHDOG_S)
        return r.returncode, r.stdout, r.stderr.decode()

    code, want, _ = generate("--no-cache")
    assert code == 0
    directory = tmp_path / model_fingerprint(DEFAULT_MODEL)[:16]
    directory.mkdir()
    os.mkfifo(directory / ("f" * 40 + SUFFIX))
    code, out, err = generate("--cache-dir", str(tmp_path))
    assert code == 0 and out == want, err
    assert [line for line in err.splitlines() if "warning" in line] == [
        f"warning: snapshot cache: skipped {directory / ('f' * 40 + SUFFIX)}: not a regular file "
        f"(a FIFO)"], err


# --- item 5: caches of data that changed ---------------------------------------------------------

def _summary_cached(err: str) -> str:
    return err.strip().splitlines()[-1]


def test_new_weights_in_an_hf_directory_miss_its_old_snapshots(tmp_path, monkeypatch, capsys):
    """Snapshots of an HF checkpoint were keyed by its headers: weights of the same shapes saved
    over it hit the old snapshots (another text, rc 0)."""
    from tests.cli import run_cli
    from tests.model import tiny

    monkeypatch.setenv("FERMIJIT_CACHE", str(tmp_path / "local"))
    hf = tiny.write_checkpoint(tmp_path / "hf", seed=0)
    flags = ("--model", hf, "the cat sat", "--max-tokens", "6", "--temperature", "0",
             "--threads", "1")
    cache = ("--cache-dir", tmp_path / "snapshots")
    assert run_cli(monkeypatch, capsys, "generate", *flags, *cache)[0] == 0
    tiny.write_checkpoint(hf, seed=1)  # new weights, same shapes, same headers
    code, out, err = run_cli(monkeypatch, capsys, "generate", *flags, *cache)
    fresh = run_cli(monkeypatch, capsys, "generate", *flags, "--no-cache")
    assert code == 0 and out == fresh[1], err
    assert "(0 from the cache)" in _summary_cached(err)
    code, _, err = run_cli(monkeypatch, capsys, "generate", *flags, *cache)
    assert code == 0 and "(0 from the cache)" not in _summary_cached(err)  # its own, now


def test_a_gguf_changed_in_place_converts_again(tmp_path, monkeypatch, capsys):
    """Its conversion was keyed by size and header: new data, the old conversion (rc 0)."""
    import shutil

    from fermijit.model.gguf_io import GgufFile
    from tests.cli import run_cli
    from tests.model import gguf_data

    monkeypatch.setenv("FERMIJIT_CACHE", str(tmp_path / "local"))
    path = tmp_path / "m.gguf"
    shutil.copyfile(gguf_data.Q8_0, path)
    flags = ("--model", path, "the cat sat", "--max-tokens", "6", "--temperature", "0",
             "--threads", "1")
    code, before, err = run_cli(monkeypatch, capsys, "generate", *flags)
    assert code == 0 and "converting" in err
    t = GgufFile(path).tensors["output.weight"]  # Q8_0 blocks: 2 bytes of scale, 32 quants
    stat = path.stat()
    with open(path, "r+b") as f:
        for block in range(t.n_bytes // 34):
            f.seek(t.data_offset + 34 * block + 2)
            f.write(bytes(32))  # every quant 0: the head's logits all 0
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with its old mtime
    code, after, err = run_cli(monkeypatch, capsys, "generate", *flags)
    assert code == 0 and "converting" in err, err
    monkeypatch.setenv("FERMIJIT_CACHE", str(tmp_path / "fresh"))
    assert run_cli(monkeypatch, capsys, "generate", *flags)[1] == after != before


def test_a_file_is_hashed_again_only_when_its_stamp_changes(tmp_path, monkeypatch):
    from fermijit.model import data_hash

    monkeypatch.setenv("FERMIJIT_CACHE", str(tmp_path / "local"))
    calls = []
    real = data_hash._hash
    monkeypatch.setattr(data_hash, "_hash", lambda path, n: calls.append(path) or real(path, n))
    path = tmp_path / "w.bin"
    path.write_bytes(b"a" * 1000)
    first = data_hash.file_sha256(path)
    assert data_hash.file_sha256(path) == first and len(calls) == 1  # from its record
    stat = path.stat()
    with open(path, "r+b") as f:
        f.write(b"b")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert data_hash.file_sha256(path) != first and len(calls) == 2
