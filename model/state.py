"""The decode state of one sequence: what prefill leaves and decode extends (DESIGN.md, Data flow),
and what the snapshot prefix cache copies, stores and restores.

Per attention layer a KV cache preallocated to the context length S, in the [Hkv, S, D] layout
ops.attention reads (MODEL.md §5.7: post-norm, post-RoPE): fp32, or Q8_0 rows (the default:
int8 codes [Hkv, S, D] and an fp32 scale per 32-block [Hkv, S, D/32],
ops/kv_quant.py); per GDN layer the conv window [C, Kc-1] (the last pre-conv inputs, oldest
first, as ops.conv1d keeps it) and the recurrent state [Hv, dk, dv] (MODEL.md §6), fp32; and the
position, the number of tokens seen. Cache rows at or past `position` are never read, so copies
and files hold only rows [0, position).

A cache is allocated for its whole context but takes memory as it is used: its
arrays are address space of their own (`reserved`), whose pages the OS backs with memory when
first written, so `--ctx` up to the model's 262,144 positions costs nothing until the positions
are reached. `new_state` checks the memory of the positions a caller expects to use, and the
state checks each further GROW_POSITIONS as it grows (`check_room`): a context that cannot grow
is a one-line error, not the OOM killer.

A state for speculative decoding with the model's MTP head (MODEL.md §10; model/mtp.py) has one
more attention layer, last: the MTP layer's own KV cache, whose row q is the pair (token q+1,
hidden state q), so it lags the model by one position (rows [0, position - 1) at rest; the last
row a copy or file holds may be stale); and `hidden`, the final normed hidden states the head
has not consumed yet (one at rest: the last position's).

Dimension legend: as model/weights.py; S the context length.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import mmap
import os
import zipfile
from pathlib import Path

import numpy as np

from fermijit import FermijitError
from fermijit.ops import kv_quant
from fermijit.ops.kv_quant import Q8Rows

# 1: fp32 caches only ("i.k", "i.v"); 2: also Q8_0 ones ("i.k.qs", "i.k.d", ...). Both load.
STATE_FORMAT = 2
READABLE_FORMATS = (1, 2)


class KvKind(enum.Enum):
    """What a KV cache holds: `--kv-cache f32|q8_0`."""

    F32 = "f32"
    Q8_0 = "q8_0"

    def row_nbytes(self, dim: int) -> int:
        """Bytes of one position's key (or value) row of one kv head."""
        return 4 * dim if self is KvKind.F32 else dim + 4 * (dim // kv_quant.BLOCK)


# Positions a state checks the memory of at a time as it grows (check_room): 12 MB of the
# full-size model's Q8_0 caches; one read of /proc/meminfo (~20 us) per 1024 tokens.
GROW_POSITIONS = 1024


def reserved(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Zeros of `shape` in an anonymous mapping of their own: each page takes memory when it is
    first written (malloc's zeroed blocks below 32 MiB come from the heap, zeroed and resident
    at once). Unmapped when the array is collected."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes < mmap.PAGESIZE:
        return np.zeros(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                         dtype).reshape(shape)


# The default (issue 31 item 1): a quarter of fp32's memory and reads at 1-2 % of the fp32 cache's
# attention output error (tests/ops/test_attention.py), perplexity within 0.5 % (fermijit eval).
DEFAULT_KV = KvKind.Q8_0


@dataclasses.dataclass
class KvCache:
    k: np.ndarray | Q8Rows  # [Hkv, S, D] fp32, or its Q8_0 rows
    v: np.ndarray | Q8Rows

    @classmethod
    def zeros(cls, kind: KvKind, heads: int, context: int, dim: int) -> "KvCache":
        shape = (heads, context, dim)
        if kind is KvKind.F32:
            return cls(reserved(shape, np.float32), reserved(shape, np.float32))
        return cls(kv_quant.empty(shape, reserved), kv_quant.empty(shape, reserved))

    @property
    def kind(self) -> KvKind:
        return KvKind.Q8_0 if isinstance(self.k, Q8Rows) else KvKind.F32

    @property
    def context(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays (address space: see the module docstring for memory)."""
        return self.k.nbytes + self.v.nbytes

    @property
    def position_nbytes(self) -> int:
        """Bytes one position takes (its key and value rows, every head)."""
        return self.nbytes // max(self.context, 1)

    @property
    def arrays(self) -> list[np.ndarray]:
        """k then v; a Q8_0 one's codes then scales."""
        return [a for x in (self.k, self.v) for a in ((x.qs, x.d) if isinstance(x, Q8Rows)
                                                      else (x,))]

    def rows(self, start: int, end: int) -> "KvCache":
        """Positions start..end-1 (views)."""
        return KvCache(self.k[:, start:end], self.v[:, start:end])

    def copy(self) -> "KvCache":
        return KvCache(self.k.copy(), self.v.copy())

    def resized(self, context: int, position: int) -> "KvCache":
        """A new cache of `context` positions holding this one's rows [0, position)."""
        heads, _, dim = self.k.shape
        out = KvCache.zeros(self.kind, heads, context, dim)
        out.put(0, self.rows(0, position))
        return out

    def put(self, start: int, rows: "KvCache") -> None:
        """Rows start.. <- `rows` (a cache of the same kind)."""
        end = start + rows.context
        self.k[:, start:end], self.v[:, start:end] = rows.k, rows.v

    def write(self, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Rows start..start+T-1 <- a pass's keys and values k, v [T, Hkv, D] fp32 (rounded to
        Q8_0 for a Q8_0 cache)."""
        if isinstance(self.k, Q8Rows):
            kv_quant.store(k, self.k, start)
            kv_quant.store(v, self.v, start)
            return
        self.k[:, start:start + k.shape[0]] = k.transpose(1, 0, 2)
        self.v[:, start:start + v.shape[0]] = v.transpose(1, 0, 2)


class GdnState:
    """One GDN layer's conv window [C, Kc-1] and recurrent state [Hv, dk, dv], fp32.

    A verify step of 2 rows (model/batch.py, ops/gdn_rows.py) leaves the recurrent array (`held`)
    as after its first row and the last row's rank-1 update `pending` (a gdn_rows.Pending), so
    that a rollback of the last row is free and the step's state traffic a token's; the next
    such step applies it on the fly. `recurrent` is the state after every token seen: reading it
    applies a pending row first (`settle`, the bits of an applied one), so every other reader
    (decode, prefill, copies, snapshots) sees a settled state."""

    def __init__(self, conv: np.ndarray, recurrent: np.ndarray):
        self.conv = conv
        self.held = recurrent
        self.pending = None  # gdn_rows.Pending, made by the first verify step of 2 rows

    @property
    def recurrent(self) -> np.ndarray:
        self.settle()
        return self.held

    @recurrent.setter
    def recurrent(self, state: np.ndarray) -> None:
        self.held = state
        if self.pending is not None:  # a whole new state: no row pending on it
            self.pending.is_set[0] = 0

    def settle(self) -> None:
        """Apply the pending row, if any (in place)."""
        if self.pending is not None:
            self.pending.settle(self.held)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.held.nbytes

    @property
    def arrays(self) -> list[np.ndarray]:
        return [self.conv, self.recurrent]


@dataclasses.dataclass
class State:
    position: int                     # tokens seen; the next token's position
    layers: list[KvCache | GdnState]  # one per layer
    # RoPE position minus `position` from here on: negative after images, whose tokens take
    # fewer positions than their count (model/multimodal.py); 0 for text.
    rope_delta: int = 0
    # With the MTP layer (its cache the last of `layers`): the final normed hidden states of
    # positions [position - k, position), [k, H] fp32, the MTP rows not computed yet; else None.
    hidden: np.ndarray | None = None
    # Positions whose memory was checked (check_room).
    memory_checked_to: int = dataclasses.field(default=0, repr=False, compare=False)

    @property
    def context(self) -> int:
        """Positions the KV caches hold (S); unbounded (a large number) without attention."""
        return min((s.context for s in self.layers if isinstance(s, KvCache)),
                   default=np.iinfo(np.int64).max)

    @property
    def kv_kind(self) -> KvKind | None:
        """What its KV caches hold (None: no attention layer)."""
        return next((s.kind for s in self.layers if isinstance(s, KvCache)), None)

    @property
    def nbytes(self) -> int:
        """Bytes of its arrays (the KV caches' whole context: address space, not memory)."""
        return (sum(s.nbytes for s in self.layers)
                + (0 if self.hidden is None else self.hidden.nbytes))

    @property
    def position_nbytes(self) -> int:
        """Bytes each position takes in the KV caches, every layer."""
        return sum(s.position_nbytes for s in self.layers if isinstance(s, KvCache))

    @property
    def used_nbytes(self) -> int:
        """Memory its positions so far take: the KV rows [0, position) and the GDN states."""
        return (self.position * self.position_nbytes
                + sum(s.nbytes for s in self.layers if isinstance(s, GdnState)))

    def check_room(self, n_tokens: int) -> None:
        """FermijitError unless `n_tokens` more positions fit the context and the memory
        available holds their KV rows (checked GROW_POSITIONS ahead, so rarely)."""
        end = self.position + n_tokens
        if end > self.context:
            raise FermijitError(f"context full: {self.position} positions seen plus "
                                f"{n_tokens} new exceed the context of {self.context}")
        if end <= self.memory_checked_to:
            return
        ahead = min(self.context, end + GROW_POSITIONS)
        nbytes = (ahead - max(self.memory_checked_to, self.position)) * self.position_nbytes
        available = available_nbytes()
        if nbytes > available:
            raise FermijitError(f"out of memory for the KV cache: positions {self.position} to "
                                f"{ahead} need {nbytes / 2**20:.0f} MiB, "
                                f"{available / 2**20:.0f} MiB is available")
        self.memory_checked_to = ahead

    def copy(self, context: int | None = None) -> "State":
        """An independent copy, its caches allocated to `context` (default: this one's)."""
        context = self.context if context is None else context
        if context < self.position:
            raise FermijitError(f"state: a context of {context} cannot hold the {self.position} "
                                f"positions seen")
        layers = []
        for s in self.layers:
            if isinstance(s, KvCache):
                layers.append(s.resized(context, self.position))
            else:
                layers.append(GdnState(s.conv.copy(), s.recurrent.copy()))
        return State(self.position, layers, self.rope_delta,
                     None if self.hidden is None else self.hidden.copy())

    def save(self, path: str | Path) -> None:
        """An .npz file (uncompressed: the recurrent state is noise-like fp32)."""
        arrays = {"format_version": np.int64(STATE_FORMAT), "position": np.int64(self.position),
                  "rope_delta": np.int64(self.rope_delta)}
        for i, s in enumerate(self.layers):
            if isinstance(s, KvCache):
                for x, name in ((s.k, "k"), (s.v, "v")):
                    x = x[:, :self.position]
                    if isinstance(x, Q8Rows):
                        arrays[f"{i}.{name}.qs"], arrays[f"{i}.{name}.d"] = x.qs, x.d
                    else:
                        arrays[f"{i}.{name}"] = x
                arrays[f"{i}.context"] = np.int64(s.context)
            else:
                arrays[f"{i}.conv"], arrays[f"{i}.recurrent"] = s.conv, s.recurrent
        if self.hidden is not None:
            arrays["hidden"] = self.hidden
        with open(path, "wb") as f:
            np.savez(f, **arrays)

    @classmethod
    def load(cls, path: str | Path, context: int | None = None) -> "State":
        """A state saved by `save` (either format), its caches allocated to `context` (default:
        as saved), of the kind saved."""
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {name: z[name] for name in z.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise FermijitError(f"{path}: not a readable state file ({e})") from None
        if int(arrays.get("format_version", -1)) not in READABLE_FORMATS:
            raise FermijitError(f"{path}: not a state file of format "
                                f"{' or '.join(map(str, READABLE_FORMATS))}")
        position = int(arrays["position"])
        layers: list[KvCache | GdnState] = []
        i = 0

        def rows(name: str):
            if f"{name}.qs" in arrays:
                return Q8Rows(np.ascontiguousarray(arrays[f"{name}.qs"], np.int8),
                              np.ascontiguousarray(arrays[f"{name}.d"], np.float32))
            return np.ascontiguousarray(arrays[name], np.float32)

        while any(f"{i}.{x}" in arrays for x in ("k", "k.qs", "conv")):
            if f"{i}.conv" not in arrays:
                n = int(arrays[f"{i}.context"]) if context is None else context
                if n < position:
                    raise FermijitError(f"{path}: a context of {n} cannot hold the {position} "
                                        f"positions seen")
                saved = KvCache(rows(f"{i}.k"), rows(f"{i}.v"))
                if saved.context < position:
                    raise FermijitError(f"{path}: layer {i} holds {saved.context} positions, "
                                        f"not {position}")
                layers.append(saved.resized(n, position))
            else:
                layers.append(GdnState(np.ascontiguousarray(arrays[f"{i}.conv"], np.float32),
                                       np.ascontiguousarray(arrays[f"{i}.recurrent"], np.float32)))
            i += 1
        hidden = arrays.get("hidden")
        return cls(position, layers, int(arrays.get("rope_delta", 0)),
                   None if hidden is None else np.ascontiguousarray(hidden, np.float32))


def available_nbytes() -> int:
    """Memory this process can still get: MemAvailable, less where a cgroup limit is lower."""
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    room = cgroup_room()
    return available if room is None else min(available, room)


# (the controller's folder under the mount, its limit file, its usage file) for cgroup v2, and
# v1's memory controller
_CGROUP_FILES = (("", "memory.max", "memory.current"),
                 ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes"))


def cgroup_room(root: Path = Path("/sys/fs/cgroup"),
                membership: Path = Path("/proc/self/cgroup")) -> int | None:
    """Bytes the memory cgroups of this process still allow (limit less usage, the least over
    its group and their ancestors), None where none limits it. Only a limit at the mount's root
    had been read, cgroup v2's: a group below it (`systemd-run -p MemoryMax=2G`) or cgroup v1's
    (an older Docker host) was missed, and a context or cache sized by the host's memory was
    ended by the OOM killer, SIGKILL without a word."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        lines = []
    paths = {"": "/", "memory": "/"}  # the mount's root: a container's own view (cgroupns)
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            paths[""] = path
        elif "memory" in controllers.split(","):
            paths["memory"] = path
    rooms = []
    for folder, limit_file, usage_file in _CGROUP_FILES:
        group = root / folder / paths[folder].lstrip("/")
        for directory in [group, *group.parents]:
            try:
                limit = (directory / limit_file).read_text().strip()
                if limit != "max":
                    rooms.append(int(limit) - int((directory / usage_file).read_text()))
            except (OSError, ValueError):
                pass
            if directory == root / folder or directory == root:
                break
    return min(rooms) if rooms else None


def state_nbytes(layer_kinds: tuple[bool, ...], context: int, kv_shape: tuple[int, int],
                 conv_shape: tuple[int, int], recurrent_shape: tuple[int, int, int],
                 kv: KvKind = DEFAULT_KV) -> int:
    """Memory a `new_state` takes holding `context` positions, in Python integers."""
    n_attention = sum(layer_kinds)
    per_gdn = 4 * (math.prod(conv_shape) + math.prod(recurrent_shape))
    hkv, d = kv_shape
    return (n_attention * 2 * context * hkv * kv.row_nbytes(d)
            + (len(layer_kinds) - n_attention) * per_gdn)


def new_state(layer_kinds: tuple[bool, ...], context: int, kv_shape: tuple[int, int],
              conv_shape: tuple[int, int], recurrent_shape: tuple[int, int, int],
              kv: KvKind = DEFAULT_KV, positions: int | None = None, gdn=None) -> State:
    """Zeros: `layer_kinds[i]` is True for an attention layer; kv_shape (Hkv, D), conv_shape
    (C, Kc-1), recurrent_shape (Hv, dk, dv); KV caches of kind `kv` for `context` positions;
    each GDN layer's state `gdn()` where that gives one (zeroed, of these shapes: the server's
    pool, fermijit/server/state_pool.py), else new zeros.
    When the `positions` the caller will use (default: all of them) need more than the memory
    available, a FermijitError saying so, before any allocation (an over-large cache
    failed later, or was killed); the rest is checked as the state grows (check_room)."""
    positions = context if positions is None else min(positions, context)
    nbytes = state_nbytes(layer_kinds, positions, kv_shape, conv_shape, recurrent_shape, kv)
    available = available_nbytes()
    if nbytes > available:
        raise FermijitError(f"a context of {positions} tokens needs {nbytes / 2**30:.2f} GiB "
                            f"for the KV cache and recurrent state, {available / 2**30:.2f} GiB "
                            f"of memory is available: use a smaller --ctx")
    hkv, d = kv_shape
    layers: list[KvCache | GdnState] = [
        KvCache.zeros(kv, hkv, context, d) if is_attention else
        (gdn and gdn()) or GdnState(np.zeros(conv_shape, np.float32),
                                    reserved(recurrent_shape, np.float32))  # page-aligned
        for is_attention in layer_kinds]
    return State(0, layers, memory_checked_to=positions)
