"""The snapshot cache on disk (fermijit/cache/snapshot_dir.py, issue 13 items 3-4): snapshots
survive the process and are read lazily; corrupt, truncated, foreign and orphaned files are skipped
with one warning line and never used; two processes share one directory."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from fermijit.cache.prefix_cache import PrefixCache, model_fingerprint
from fermijit.cache.snapshot_dir import SUFFIX
from fermijit.model.forward import load_model
from tests.fermijit.cache.test_prefix_cache import EVERY, HIT_REL, cached, uncached
from tests.fermijit.cache.test_prefix_cache import models, one_thread  # noqa: F401  (fixtures)
from tests.model.oracle import assert_rel


@pytest.fixture(scope="module")
def q4(models):
    return load_model(models["w4a8"])[1]


def open_cache(model, directory, fingerprint="model-a", mem_bytes=2 ** 30):
    warnings = []
    cache = PrefixCache(fingerprint, mem_bytes=mem_bytes, directory=directory,
                        snapshot_every=EVERY, check=model.check_state, warn=warnings.append)
    return cache, warnings


def files(cache):
    return sorted(cache.disk.dir.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime_ns)


def test_snapshots_survive_and_load_lazily(q4, tmp_path):
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, q4.vocab_size, 30).astype(np.int32)
    writer, warnings = open_cache(q4, tmp_path)
    cached(q4, writer, prompt)
    assert len(files(writer)) == 4 and not warnings     # 8, 16, 24 and the end (30)
    # the files chain: each holds only the KV rows since its parent
    sizes = [p.stat().st_size for p in files(writer)]
    assert max(sizes) - min(sizes) < sizes[0] // 2

    for probe, want in ((prompt, 30), (prompt[:20], 16), (np.concatenate([prompt, [3, 4]]), 30)):
        reader, warnings = open_cache(q4, tmp_path)     # a new process: memory empty
        assert reader.n_snapshots == 0
        logits, n = cached(q4, reader, probe)
        assert n == want and not warnings
        assert_rel(f"{probe.size} tokens from disk", uncached(q4, probe), logits, HIT_REL)
    # the readers' new snapshots went to disk as well: the ends at 20 and 32
    assert len(files(reader)) == 6
    # lazily: a snapshot's own state is read only when it is restored, not as an ancestor
    corrupt(files(reader)[0], "flipped")                   # the state at 8
    reader, warnings = open_cache(q4, tmp_path)
    assert cached(q4, reader, prompt)[1] == 30 and not warnings


def corrupt(path, how):
    data = bytearray(path.read_bytes())
    if how == "flipped":
        data[-100] ^= 0x40                                  # in the state section
    elif how == "kv":
        header_end = 16 + int.from_bytes(data[8:16], "little")
        data[header_end + 10] ^= 0x40                       # in the KV rows
    elif how == "truncated":
        data = data[:len(data) - 1000]
    elif how == "header":
        data[20:30] = b"}}}}}}}}}}"
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flipped", "kv", "truncated", "header"])
def test_a_damaged_file_is_skipped_with_one_warning(q4, tmp_path, how):
    prompt = np.arange(10, 40, dtype=np.int32)
    writer, _ = open_cache(q4, tmp_path)
    cached(q4, writer, prompt)
    end = files(writer)[-1]                                # the snapshot at 30
    corrupt(end, how)
    reader, warnings = open_cache(q4, tmp_path)
    logits, n = cached(q4, reader, prompt)
    assert n == 24                                         # the next one down serves
    assert_rel("logits", uncached(q4, prompt), logits, HIT_REL)
    assert len(warnings) == 1 and end.name in warnings[0] and "skipped" in warnings[0]
    assert cached(q4, reader, prompt)[1] == 30 and len(warnings) == 1  # from memory now
    # the reader wrote a sound snapshot over the damaged one
    third, warnings = open_cache(q4, tmp_path)
    logits, n = cached(q4, third, prompt)
    assert n == 30 and not warnings
    assert_rel("logits", uncached(q4, prompt), logits, HIT_REL)


def test_a_file_whose_parent_is_damaged_is_not_used(q4, tmp_path):
    prompt = np.arange(50, 80, dtype=np.int32)
    writer, _ = open_cache(q4, tmp_path)
    cached(q4, writer, prompt)
    corrupt(files(writer)[0], "kv")                        # 8: its KV rows feed every child
    reader, warnings = open_cache(q4, tmp_path)
    logits, n = cached(q4, reader, prompt)
    assert n == 0 and len(warnings) == 4                   # each file once: none used
    assert any(files(writer)[0].name in w and "checksum" in w for w in warnings)
    assert_rel("logits", uncached(q4, prompt), logits, HIT_REL)


def test_foreign_and_stray_files_are_skipped(q4, models, tmp_path):
    prompt = np.arange(100, 130, dtype=np.int32)
    other, _ = open_cache(q4, tmp_path, fingerprint="model-b")
    cached(q4, other, prompt)
    mine, warnings = open_cache(q4, tmp_path)
    for f in files(other):                                 # copied in by hand
        (mine.disk.dir / f.name).write_bytes(f.read_bytes())
    (mine.disk.dir / ("0" * 40 + SUFFIX)).write_bytes(b"not a snapshot")
    (mine.disk.dir / ".tmp-abc.part").write_bytes(b"half a snapshot")  # a writer's, ignored
    logits, n = cached(q4, mine, prompt)
    assert n == 0 and len(warnings) == 5
    assert sum("another model" in w for w in warnings) == 4
    assert_rel("logits", uncached(q4, prompt), logits, HIT_REL)


def test_two_processes_share_a_directory(models, tmp_path):
    """Two `generate` runs write one directory at once; a third resumes from their snapshots."""
    d = tmp_path / "cache"
    base = ["-m", "fermijit", "generate", "--model", str(models["w4a8"]), "--max-tokens", "6",
            "--temperature", "0", "--threads", "1", "--cache-dir", str(d), "--snapshot-every", "4"]
    prompt = "the cat sat on the mat and then the dog"
    runs = [subprocess.Popen([sys.executable, *base, text], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE) for text in (prompt, prompt + " ran off")]
    outs = [r.communicate(timeout=300) for r in runs]
    assert all(r.returncode == 0 for r in runs), [o[1].decode() for o in outs]
    assert not any(b"warning" in o[1] for o in outs)
    third = subprocess.run([sys.executable, *base, prompt + " ran off"], capture_output=True,
                           timeout=300)
    fresh = subprocess.run([sys.executable, *base[:-4], "--no-cache", prompt + " ran off"],
                           capture_output=True, timeout=300)
    assert third.returncode == 0 and fresh.returncode == 0, third.stderr.decode()
    assert third.stdout == fresh.stdout == outs[1][0]
    summary = third.stderr.decode().strip().splitlines()[-1]
    n_prompt = int(summary.split()[1])
    assert f"({n_prompt} from the cache)" in summary, summary
    assert "from the cache" not in fresh.stderr.decode()
    assert not list(d.rglob(".tmp-*"))                     # no temporary file left behind


def test_fingerprint_names_the_directory(models, q4, tmp_path):
    cache = PrefixCache(model_fingerprint(models["w4a8"]), directory=tmp_path, snapshot_every=8)
    assert cache.disk.dir.parent == tmp_path and len(cache.disk.dir.name) == 16


@pytest.mark.parametrize("flags, message", [
    (("--cache-mem", "lots"), "is not a size such as 512M or 2G"),
    (("--cache-mem", "-1G"), "is not a size such as 512M or 2G"),
    (("--snapshot-every", "0"), "--snapshot-every"),
    (("--cache-dir", "FILE"), "cannot create it"),
])
def test_bad_cache_flags_are_one_line(models, tmp_path, flags, message):
    (tmp_path / "file").write_text("")
    flags = [str(tmp_path / "file" / "sub") if f == "FILE" else f for f in flags]
    r = subprocess.run([sys.executable, "-m", "fermijit", "generate", "--model",
                        str(models["w4a8"]), *flags, "hello"], capture_output=True, timeout=300)
    err = r.stderr.decode()
    assert r.returncode == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_sizes():
    from fermijit.cli import SIZE

    assert [SIZE.convert(v, None, None) for v in ("0", "1000", "512K", "64m", "2G", "1.5GiB")] \
        == [0, 1000, 512 << 10, 64 << 20, 2 << 30, 3 << 29]


def test_q8_0_files_are_smaller_and_f32_ones_still_serve_f32_runs(models, tmp_path):
    """A Q8_0 cache's snapshot stores codes and scales (issue 31): its KV section is (D + 4D/32)
    / 4D of the fp32 one's. Files of an fp32 cache (the format before Q8_0) still load for an
    fp32 run; a Q8_0 run has another key, and told to read them anyway skips them with one
    warning line."""
    from fermijit.model.state import KvKind

    f32, q8 = (load_model(models["w4a8"], kv=kv)[1] for kv in (KvKind.F32, KvKind.Q8_0))
    assert model_fingerprint(models["w4a8"], KvKind.F32) != model_fingerprint(models["w4a8"])
    prompt = np.arange(10, 40, dtype=np.int32)
    sections = {}
    for model in (f32, q8):
        cache, warnings = open_cache(model, tmp_path / model.kv_kind.value)
        cached(model, cache, prompt)
        assert not warnings
        entry = next(iter(cache.disk.entries.values()))
        sections[model.kv_kind] = entry.kv["nbytes"] / (entry.position - entry.parent_position)
    D = q8.head_dim
    assert sections[KvKind.Q8_0] / sections[KvKind.F32] == pytest.approx((D + 4 * D / 32) / (4 * D))
    reader, warnings = open_cache(f32, tmp_path / "f32")
    logits, n = cached(f32, reader, prompt)
    assert n == 30 and not warnings
    assert_rel("f32 from disk", uncached(f32, prompt), logits, HIT_REL)
    reader, warnings = open_cache(q8, tmp_path / "f32")
    assert cached(q8, reader, prompt)[1] == 0
    assert warnings and all("f32 KV cache, the model runs q8_0" in w for w in warnings)
