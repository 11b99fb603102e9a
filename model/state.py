"""The decode state of one sequence: what prefill leaves and decode extends (DESIGN.md, Data flow),
and what the snapshot prefix cache copies, stores and restores.

Per attention layer a KV cache preallocated to the context length S, in the [Hkv, S, D] layout
ops.attention reads (MODEL.md §5.7: post-norm, post-RoPE); per GDN layer the conv window
[C, Kc-1] (the last pre-conv inputs, oldest first, as ops.conv1d keeps it) and the recurrent state
[Hv, dk, dv] (MODEL.md §6), all fp32; and the position, the number of tokens seen. Cache rows at
or past `position` are never read, so copies and files hold only rows [0, position).

A state for speculative decoding with the model's MTP head (MODEL.md §10; model/mtp.py) has one
more attention layer, last: the MTP layer's own KV cache, whose row q is the pair (token q+1,
hidden state q), so it lags the model by one position (rows [0, position - 1) at rest; the last
row a copy or file holds may be stale); and `hidden`, the final normed hidden states the head
has not consumed yet (one at rest: the last position's).

Dimension legend: as model/weights.py; S the context length.
"""

from __future__ import annotations

import dataclasses
import math
import os
import zipfile
from pathlib import Path

import numpy as np

from fermijit import FermijitError

STATE_FORMAT = 1


@dataclasses.dataclass
class KvCache:
    k: np.ndarray  # [Hkv, S, D] fp32
    v: np.ndarray  # [Hkv, S, D] fp32


@dataclasses.dataclass
class GdnState:
    conv: np.ndarray       # [C, Kc-1] fp32
    recurrent: np.ndarray  # [Hv, dk, dv] fp32


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

    @property
    def context(self) -> int:
        """Positions the KV caches hold (S); unbounded (a large number) without attention."""
        return min((s.k.shape[1] for s in self.layers if isinstance(s, KvCache)),
                   default=np.iinfo(np.int64).max)

    @property
    def nbytes(self) -> int:
        return (sum(a.nbytes for s in self.layers for a in dataclasses.astuple(s))
                + (0 if self.hidden is None else self.hidden.nbytes))

    def copy(self, context: int | None = None) -> "State":
        """An independent copy, its caches allocated to `context` (default: this one's)."""
        context = self.context if context is None else context
        if context < self.position:
            raise FermijitError(f"state: a context of {context} cannot hold the {self.position} "
                                f"positions seen")
        layers = []
        for s in self.layers:
            if isinstance(s, KvCache):
                layers.append(KvCache(*(_resized(a, context, self.position) for a in (s.k, s.v))))
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
                arrays[f"{i}.k"] = s.k[:, :self.position]
                arrays[f"{i}.v"] = s.v[:, :self.position]
                arrays[f"{i}.context"] = np.int64(s.k.shape[1])
            else:
                arrays[f"{i}.conv"], arrays[f"{i}.recurrent"] = s.conv, s.recurrent
        if self.hidden is not None:
            arrays["hidden"] = self.hidden
        with open(path, "wb") as f:
            np.savez(f, **arrays)

    @classmethod
    def load(cls, path: str | Path, context: int | None = None) -> "State":
        """A state saved by `save`, its caches allocated to `context` (default: as saved)."""
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {name: z[name] for name in z.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise FermijitError(f"{path}: not a readable state file ({e})") from None
        if int(arrays.get("format_version", -1)) != STATE_FORMAT:
            raise FermijitError(f"{path}: not a state file of format {STATE_FORMAT}")
        position = int(arrays["position"])
        layers: list[KvCache | GdnState] = []
        i = 0
        while f"{i}.k" in arrays or f"{i}.conv" in arrays:
            if f"{i}.k" in arrays:
                n = int(arrays[f"{i}.context"]) if context is None else context
                if n < position:
                    raise FermijitError(f"{path}: a context of {n} cannot hold the {position} "
                                        f"positions seen")
                layers.append(KvCache(*(_resized(arrays[f"{i}.{x}"], n, position)
                                        for x in "kv")))
            else:
                layers.append(GdnState(np.ascontiguousarray(arrays[f"{i}.conv"], np.float32),
                                       np.ascontiguousarray(arrays[f"{i}.recurrent"], np.float32)))
            i += 1
        hidden = arrays.get("hidden")
        return cls(position, layers, int(arrays.get("rope_delta", 0)),
                   None if hidden is None else np.ascontiguousarray(hidden, np.float32))


def _resized(cache: np.ndarray, context: int, position: int) -> np.ndarray:
    """cache [Hkv, >= position, D] -> a new [Hkv, context, D] fp32 with rows [0, position)."""
    out = np.zeros((cache.shape[0], context, cache.shape[2]), np.float32)
    out[:, :position] = cache[:, :position]
    return out


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
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


def state_nbytes(layer_kinds: tuple[bool, ...], context: int, kv_shape: tuple[int, int],
                 conv_shape: tuple[int, int], recurrent_shape: tuple[int, int, int]) -> int:
    """Bytes of a `new_state` (fp32), computed in Python integers before anything is made."""
    n_attention = sum(layer_kinds)
    per_gdn = math.prod(conv_shape) + math.prod(recurrent_shape)
    return 4 * (n_attention * 2 * context * math.prod(kv_shape)
                + (len(layer_kinds) - n_attention) * per_gdn)


def new_state(layer_kinds: tuple[bool, ...], context: int, kv_shape: tuple[int, int],
              conv_shape: tuple[int, int], recurrent_shape: tuple[int, int, int]) -> State:
    """Zeros: `layer_kinds[i]` is True for an attention layer; kv_shape (Hkv, D), conv_shape
    (C, Kc-1), recurrent_shape (Hv, dk, dv). A state larger than the memory available is a
    FermijitError saying what it needs, before any allocation (issue 11 case 7: the zeros are
    allocated lazily, so an over-large cache failed later, or was killed)."""
    nbytes = state_nbytes(layer_kinds, context, kv_shape, conv_shape, recurrent_shape)
    available = available_nbytes()
    if nbytes > available:
        raise FermijitError(f"a context of {context} tokens needs {nbytes / 2**30:.2f} GiB for "
                            f"the KV cache and recurrent state, {available / 2**30:.2f} GiB of "
                            f"memory is available: use a smaller --ctx")
    hkv, d = kv_shape
    layers: list[KvCache | GdnState] = [
        KvCache(np.zeros((hkv, context, d), np.float32), np.zeros((hkv, context, d), np.float32))
        if is_attention else
        GdnState(np.zeros(conv_shape, np.float32), np.zeros(recurrent_shape, np.float32))
        for is_attention in layer_kinds]
    return State(0, layers)
