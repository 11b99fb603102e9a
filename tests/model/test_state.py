"""The decode state's KV caches (issue 31 items 1-2): fp32 or Q8_0 rows, cut, copied, saved and
loaded alike (an fp32 file of format 1 still loads); allocated for the whole context but taking
memory as positions are used, with memory checked as the state grows."""

from __future__ import annotations

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.model import state as state_module
from fermijit.model.state import GdnState, KvCache, KvKind, State, new_state
from fermijit.ops import kv_quant

KINDS = (True, False, True)  # attention, GDN, attention
KV, CONV, RECURRENT = (2, 64), (6, 3), (2, 8, 8)


def filled(kind: KvKind, context: int = 40, position: int = 25) -> State:
    rng = np.random.default_rng(0)
    s = new_state(KINDS, context, KV, CONV, RECURRENT, kind)
    for layer in s.layers:
        if isinstance(layer, KvCache):
            k, v = rng.standard_normal((2, position, *KV)).astype(np.float32)
            layer.write(0, k, v)
        else:
            layer.conv[...] = rng.standard_normal(CONV)
            layer.recurrent[...] = rng.standard_normal(RECURRENT)
    s.position = position
    return s


def assert_same(a: State, b: State, rows: int) -> None:
    assert a.position == b.position
    for x, y in zip(a.layers, b.layers, strict=True):
        if isinstance(x, KvCache):
            x, y = x.rows(0, rows), y.rows(0, rows)
        for u, w in zip(x.arrays, y.arrays, strict=True):
            np.testing.assert_array_equal(u, w)


@pytest.mark.parametrize("kind", KvKind, ids=[k.value for k in KvKind])
def test_copy_save_load(kind, tmp_path):
    s = filled(kind)
    assert s.kv_kind is kind
    cache = s.layers[0]
    if kind is KvKind.Q8_0:  # written rows: the reference's rounding
        assert isinstance(cache.k, kv_quant.Q8Rows) and cache.k.qs.dtype == np.int8
    assert_same(s, s.copy(60), 25)
    assert s.copy(60).context == 60
    s.save(tmp_path / "s.npz")
    loaded = State.load(tmp_path / "s.npz")
    assert loaded.kv_kind is kind and loaded.context == 40
    assert_same(s, loaded, 25)
    with pytest.raises(FermijitError, match="cannot hold"):
        State.load(tmp_path / "s.npz", context=10)


def test_q8_0_takes_a_quarter_of_fp32_and_its_rows_are_the_rounded_keys():
    f32, q8 = filled(KvKind.F32), filled(KvKind.Q8_0)
    assert q8.position_nbytes / f32.position_nbytes == (64 + 8) / 256
    for a, b in zip(f32.layers, q8.layers):
        if isinstance(a, KvCache):
            expected = kv_quant.reference(a.k[:, :25])
            np.testing.assert_array_equal(b.k.qs[:, :25], expected.qs)
            np.testing.assert_array_equal(b.k.d[:, :25], expected.d)


def test_format_1_files_load_as_fp32(tmp_path):
    """A file written before Q8_0 caches: format 1, "i.k" / "i.v" fp32 rows."""
    s = filled(KvKind.F32)
    arrays = {"format_version": np.int64(1), "position": np.int64(25),
              "rope_delta": np.int64(0)}
    for i, layer in enumerate(s.layers):
        if isinstance(layer, KvCache):
            arrays[f"{i}.k"], arrays[f"{i}.v"] = layer.k[:, :25], layer.v[:, :25]
            arrays[f"{i}.context"] = np.int64(40)
        else:
            arrays[f"{i}.conv"], arrays[f"{i}.recurrent"] = layer.conv, layer.recurrent
    np.savez(tmp_path / "old.npz", **arrays)
    loaded = State.load(tmp_path / "old.npz")
    assert loaded.kv_kind is KvKind.F32
    assert_same(s, loaded, 25)
    arrays["format_version"] = np.int64(9)
    np.savez(tmp_path / "future.npz", **arrays)
    with pytest.raises(FermijitError, match="not a state file of format 1 or 2"):
        State.load(tmp_path / "future.npz")


def test_a_cache_of_the_whole_context_costs_only_its_positions():
    """262,144 positions of a full-size attention layer's fp32 cache: 1 GiB of address space;
    writing 1000 positions takes their pages only."""
    def rss() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

    before = rss()
    cache = KvCache.zeros(KvKind.F32, 2, 262144, 256)
    assert cache.nbytes == 2 ** 30
    k = np.ones((1000, 2, 256), np.float32)
    cache.write(0, k, k)
    grown = rss() - before
    assert 4 * 1000 * 2 * 256 * 2 <= grown < 16 * 2 ** 20, grown
    assert cache.k[1, 999, 255] == 1 and cache.k[1, 262143, 0] == 0


def test_memory_is_checked_for_the_positions_used_and_as_the_state_grows(monkeypatch):
    per_position = 2 * 2 * 2 * 4 * 64                    # 2 layers, k and v, 2 heads, fp32
    gdn = 4 * (6 * 3 + 2 * 8 * 8)
    monkeypatch.setattr(state_module, "available_nbytes", lambda: gdn + 100 * per_position)
    with pytest.raises(FermijitError, match="a context of 200 tokens needs"):
        new_state(KINDS, 200, KV, CONV, RECURRENT, KvKind.F32)
    s = new_state(KINDS, 100_000, KV, CONV, RECURRENT, KvKind.F32, positions=50)
    s.check_room(50)                                      # checked when made
    with pytest.raises(FermijitError, match="out of memory for the KV cache: positions 0 to"):
        s.check_room(51)                                  # 51 + GROW_POSITIONS ahead: too many
    monkeypatch.setattr(state_module, "available_nbytes", lambda: 1 << 40)
    s.check_room(51)
    assert s.memory_checked_to == 51 + state_module.GROW_POSITIONS
    with pytest.raises(FermijitError, match="context full"):
        s.check_room(100_001)


def test_gdn_layers_and_kinds():
    s = filled(KvKind.Q8_0)
    assert isinstance(s.layers[1], GdnState) and s.layers[1].arrays[0] is s.layers[1].conv
    assert new_state((False,), 5, KV, CONV, RECURRENT).kv_kind is None
