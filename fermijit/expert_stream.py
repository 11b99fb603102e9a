"""Routed experts streamed to the GPU during prefill (issue 10): host sources and the copy stream.

A layer's routed experts are four arrays [E, ...] (ops.moe.MoeWeights: gate_up qs and d, down qs
and d). On the device they live in a buffer of the same layout (four regions of E experts), so
the expert kernels index it by expert id as they index a resident tensor; only the experts asked
for are copied in (fermijit/gpu_prefill.py decides which, and when). The copies go on a stream of
their own that does not wait for the kernels, an event after each batch.

Host sources, one per `--pin-budget` outcome (and the bench's baseline):
  pinned    the whole expert pool in page-locked memory, copied from the model file once: the DMA
            engine reads it directly, asynchronously;
  ring      a ring of page-locked staging slots of RING_SLOT_BYTES, refilled by the host from the
            (memory-mapped, pageable) model file while the previous slot is on the link;
  pageable  copies straight from the model file: the driver stages them itself, synchronously.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fermijit import FermijitError
from fermijit.ops import moe

SOURCES = ("pinned", "ring", "pageable")
RING_SLOTS = 3               # staging slots: one being filled, one on the link, one spare
RING_SLOT_BYTES = 64 << 20   # at most, per slot (less within a small --pin-budget)


def expert_arrays(w: moe.MoeWeights) -> tuple[np.ndarray, ...]:
    """A layer's routed experts as four [E, bytes] uint8 views (no copy)."""
    arrays = (w.gate_up_qs, w.gate_up_d, w.down_qs, w.down_d)
    return tuple(np.asarray(a).reshape(a.shape[0], -1).view(np.uint8) for a in arrays)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Bytes of one expert in each of the four arrays; E experts; the device buffer's regions."""

    per_expert: tuple[int, int, int, int]
    n_experts: int

    @classmethod
    def of(cls, w: moe.MoeWeights) -> "Layout":
        arrays = expert_arrays(w)
        return cls(tuple(int(a.shape[1]) for a in arrays), int(arrays[0].shape[0]))

    @property
    def expert_bytes(self) -> int:
        return sum(self.per_expert)

    @property
    def layer_bytes(self) -> int:
        return self.n_experts * self.expert_bytes

    @property
    def offsets(self) -> tuple[int, int, int, int]:
        """Start of each array's region in a layer buffer."""
        starts = np.concatenate([[0], np.cumsum(self.per_expert)[:-1]]) * self.n_experts
        return tuple(int(s) for s in starts)


def runs(needed: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs [a, b) of needed experts (needed: bool [E])."""
    inside = np.concatenate([[False], needed, [False]]).astype(np.int8)
    change = np.flatnonzero(np.diff(inside))
    return [(int(a), int(b)) for a, b in zip(change[::2], change[1::2])]


class Streamer:
    """Copies a layer's needed experts into a device buffer, group by group, on a copy stream."""

    def __init__(self, layers: list[moe.MoeWeights], source: str,
                 ring_slot_bytes: int = RING_SLOT_BYTES):
        from fermijit.jit import gpu

        if source not in SOURCES:
            raise FermijitError(f"expert source must be one of {SOURCES}, got {source!r}")
        self.layout = Layout.of(layers[0])
        self.source = source
        self.host = [expert_arrays(w) for w in layers]
        self.stream = gpu.copy_stream()
        self.pool: list[np.ndarray] = []
        if source == "pinned":
            for arrays in self.host:
                buf = gpu.pinned(self.layout.layer_bytes)
                for start, a in zip(self.layout.offsets, arrays):
                    buf[start:start + a.size] = a.reshape(-1)
                self.pool.append(buf)
        self.slot_bytes = ring_slot_bytes
        self.ring = ([gpu.pinned(ring_slot_bytes) for _ in range(RING_SLOTS)]
                     if source == "ring" else [])
        self.ring_events: list = [None] * len(self.ring)
        self._next_slot = 0
        self.bytes_copied = 0

    @property
    def pinned_bytes(self) -> int:
        return sum(b.nbytes for b in self.pool) + sum(b.nbytes for b in self.ring)

    def copy(self, layer: int, experts: np.ndarray, device_base: int):
        """Issue the copies of `experts` (bool [E]) of `layer` into a layer buffer at
        `device_base`; returns an event recorded after them on the copy stream."""
        from fermijit.jit import gpu

        cuda = gpu.driver()
        lay, arrays = self.layout, self.host[layer]
        pieces = []  # (device address, host bytes)
        for a, b in runs(experts):
            for r, (start, size) in enumerate(zip(lay.offsets, lay.per_expert)):
                if self.source == "pinned":
                    src = self.pool[layer][start + a * size:start + b * size]
                else:
                    src = arrays[r][a:b].reshape(-1)
                pieces.append((device_base + start + a * size, src))
        with gpu.check(f"copying experts of layer {layer} to the device"):
            if self.source == "ring":
                self._staged(pieces)
            else:
                for address, src in pieces:
                    cuda.memcpy_htod_async(address, src, self.stream)
                    self.bytes_copied += src.nbytes
            done = gpu.event()
            done.record(self.stream)
        return done

    def _staged(self, pieces) -> None:
        """The pieces through the ring: each slot filled by the host once its previous copy has
        left it, then copied from on the stream."""
        from fermijit.jit import gpu

        cuda = gpu.driver()
        for address, src in pieces:
            for at in range(0, src.nbytes, self.slot_bytes):
                part = src[at:at + self.slot_bytes]
                slot = self._next_slot
                self._next_slot = (slot + 1) % len(self.ring)
                if self.ring_events[slot] is not None:
                    self.ring_events[slot].synchronize()
                buf = self.ring[slot][:part.nbytes]
                buf[:] = part
                cuda.memcpy_htod_async(address + at, buf, self.stream)
                self.bytes_copied += part.nbytes
                self.ring_events[slot] = gpu.event()
                self.ring_events[slot].record(self.stream)
