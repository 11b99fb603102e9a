"""Snapshot lookups at the edges (issue 33 item 1), in memory (fermijit/cache/prefix_cache.py) and
on disk (fermijit/cache/snapshot_dir.py): prompts that part from a stored one at, one before and one
after a snapshot position, at a snapshot's last token, at the stored prompt's last token, with equal
length and another last token. The state restored must be a fresh prefill of the longest prefix
the prompt truly shares with a snapshot, bit for bit (the same prefill passes on the CPU give the
same bits), and the logits with it only where that prefix is the whole prompt.

A lookup that compares a snapshot's tokens but its last (planted in both stores: issue 33) serves
a prompt parting at token 15 from the snapshot at 16: the tests_at_snapshot_last_token cases."""

from __future__ import annotations

import numpy as np
import pytest

from fermijit.cache.prefix_cache import PrefixCache
from fermijit.cache.snapshot_dir import SUFFIX
from fermijit.engine import prefill
from fermijit.model.forward import load_model
from tests.fermijit.cache.test_prefix_cache import CONTEXT, EVERY
from tests.fermijit.cache.test_prefix_cache import models, one_thread  # noqa: F401  (fixtures)

N_STORED = 41      # snapshots at 8, 16, 24, 32, 40 (no logits) and 41 (the end: with logits)
SNAPSHOTS = (8, 16, 24, 32, 40)

# (id, where the probe parts from the stored prompt (None: it does not), its length, the
# position it must resume from). A snapshot at the probe's own end serves only with its logits.
PROBES = [
    ("parts-at-0", 0, 20, 0),
    ("parts-at-snapshot-8s-last-token", 7, 20, 0),
    ("parts-just-after-8", 8, 20, 8),
    ("parts-just-before-16s-last-token", 14, 30, 8),
    ("parts-at-snapshot-16s-last-token", 15, 30, 8),
    ("parts-just-after-16", 16, 30, 16),
    ("parts-at-17", 17, 30, 16),
    ("same-length-16-other-last-token", 15, 16, 8),
    ("same-length-17-other-last-token", 16, 17, 16),
    ("parts-at-stored-last-token", 40, 45, 40),
    ("same-length-other-last-token", 40, N_STORED, 40),
    ("prefix-ending-at-16", None, 16, 8),
    ("prefix-ending-at-17", None, 17, 16),
    ("prefix-ending-at-40", None, 40, 32),
    ("the-stored-prompt", None, N_STORED, N_STORED),
    ("extends-the-stored-prompt", None, 50, N_STORED),
]


@pytest.fixture(scope="module")
def q4(models):
    return load_model(models["w4a8"])[1]


@pytest.fixture(scope="module")
def fp32(models):
    return load_model(models["fp32"])[1]


def probe(base: np.ndarray, parts_at: int | None, length: int, vocab: int) -> np.ndarray:
    """`length` tokens equal to base's before `parts_at` and different at it (then random)."""
    rng = np.random.default_rng(length * 100 + (parts_at or 0))
    tokens = rng.integers(0, vocab, length).astype(np.int32)
    same = min(length, base.size) if parts_at is None else parts_at
    tokens[:same] = base[:same]
    if parts_at is not None:
        tokens[parts_at] = (base[parts_at] + 1 + rng.integers(vocab - 1)) % vocab
    return tokens


def fresh(model, tokens: np.ndarray):
    """(state, logits) of a prefill of `tokens` from nothing, in the passes a cache aligns to."""
    state = model.new_state(CONTEXT)
    logits = model.prefill(tokens, state, align=EVERY)
    return state, logits


def assert_same_state(tmp_path, expected, actual) -> None:
    """The two states hold the same bits: position, every KV row seen, every GDN state (compared
    through State.save, which writes exactly what a state is)."""
    assert actual.position == expected.position
    files = []
    for name, state in (("expected", expected), ("actual", actual)):
        path = tmp_path / f"{name}.npz"
        state.save(path)
        files.append(np.load(path))
    assert sorted(files[0].files) == sorted(files[1].files)
    for key in files[0].files:
        np.testing.assert_array_equal(files[1][key], files[0][key], f"state array {key}")


def stored_prompt(vocab: int) -> np.ndarray:
    return np.random.default_rng(33).integers(0, vocab, N_STORED).astype(np.int32)


@pytest.fixture(scope="module")
def memory_caches(q4, fp32):
    """{kind: (model, a cache holding the stored prompt's snapshots)}; lookups leave it as is."""
    caches = {}
    for kind, model in (("w4a8", q4), ("fp32", fp32)):
        cache = PrefixCache("lookup", mem_bytes=2 ** 30, snapshot_every=EVERY)
        prefill(model, stored_prompt(model.vocab_size), CONTEXT, cache)
        assert cache.n_snapshots == len(SNAPSHOTS) + 1
        caches[kind] = model, cache
    return caches


@pytest.fixture(scope="module")
def disk_dir(q4, tmp_path_factory):
    directory = tmp_path_factory.mktemp("lookup-disk")
    writer = PrefixCache("lookup", mem_bytes=2 ** 30, directory=directory, snapshot_every=EVERY,
                         check=q4.check_state)
    prefill(q4, stored_prompt(q4.vocab_size), CONTEXT, writer)
    assert len(list(writer.disk.dir.glob("*" + SUFFIX))) == len(SNAPSHOTS) + 1
    return directory


def check_lookup(tmp_path, model, cache, tokens, want):
    state, logits = cache.restore(tokens, CONTEXT)
    if want == 0:
        assert state is None and logits is None
        return
    assert state is not None, f"nothing restored; want the snapshot at {want}"
    assert state.position == want, f"restored at {state.position}, want {want}"
    expected_state, expected_logits = fresh(model, tokens[:want])
    assert_same_state(tmp_path, expected_state, state)
    if want == tokens.size:
        np.testing.assert_array_equal(logits, expected_logits, "logits after the whole prompt")
    else:
        assert logits is None, "logits given with tokens left to prefill"


@pytest.mark.parametrize("parts_at, length, want", [p[1:] for p in PROBES],
                         ids=[p[0] for p in PROBES])
@pytest.mark.parametrize("kind", ["w4a8", "fp32"])
def test_memory_lookup(tmp_path, memory_caches, kind, parts_at, length, want):
    model, cache = memory_caches[kind]
    tokens = probe(stored_prompt(model.vocab_size), parts_at, length, model.vocab_size)
    check_lookup(tmp_path, model, cache, tokens, want)


@pytest.mark.parametrize("parts_at, length, want", [p[1:] for p in PROBES],
                         ids=[p[0] for p in PROBES])
def test_disk_lookup(tmp_path, q4, disk_dir, parts_at, length, want):
    """A new process's cache (memory empty) over the stored files."""
    reader = PrefixCache("lookup", mem_bytes=2 ** 30, directory=disk_dir, snapshot_every=EVERY,
                         check=q4.check_state, warn=pytest.fail)
    assert reader.n_snapshots == 0
    tokens = probe(stored_prompt(q4.vocab_size), parts_at, length, q4.vocab_size)
    check_lookup(tmp_path, q4, reader, tokens, want)


def test_disk_lookup_deeper_than_memory(tmp_path, q4, disk_dir):
    """Memory holds a true prefix's snapshot, disk a deeper one the prompt only seems to share
    (all but its last token): memory's is restored, disk's never."""
    base = stored_prompt(q4.vocab_size)
    reader = PrefixCache("lookup", mem_bytes=2 ** 30, directory=disk_dir, snapshot_every=EVERY,
                         check=q4.check_state, warn=pytest.fail)
    tokens = probe(base, 23, 30, q4.vocab_size)     # parts at snapshot 24's last token
    state, _ = fresh(q4, tokens[:16])
    reader.add(tokens[:16], state)                  # memory: the snapshot at 16 (also on disk)
    check_lookup(tmp_path, q4, reader, tokens, 16)
