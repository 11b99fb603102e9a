"""Routed experts streamed to the GPU during prefill: host sources and the copy stream.

A layer's routed experts are four arrays [E, ...] (ops.moe.MoeWeights: gate_up qs and d, down qs
and d), or, for GGUF K-quant blocks kept as imported (model/block_moe.py BlockExperts), one
[E, ...] array of blocks per matrix (a Q4_0 matrix among them its qs and d). On the device they
live in a buffer of the same layout (a region of E experts per array, each region starting on
REGION_ALIGN bytes: the K-quant GEMMs read 16-byte-aligned blocks), so
the expert kernels index it by expert id as they index a resident tensor; only the experts asked
for are copied in (fermijit/prefill/gpu_prefill.py decides which, and when). The copies go on a
stream of their own that does not wait for the kernels, an event after each batch.

Host sources, one per `--pin-budget` outcome (and the bench's baseline). The experts are ~90 % of
the model's bytes, so every source keeps ONE copy of them in host RAM, the one CPU decode reads
too (a second, page-locked copy beside the model file's pages had doubled the RSS):
  mapped    the model file's own mapped pages, page-locked in place (registered with the driver,
            read-only: CUDA >= 11.1; Fermi's last driver cannot register a read-only mapping):
            the DMA engine reads what decode reads, no copy, nothing more resident;
  pinned    where `mapped` is refused: the expert pool copied once into page-locked memory,
            layer by layer, each layer's file pages then released from the process and the CPU
            model's expert arrays pointed at the pool (`Streamer.rebind`), so decode reads the pool;
  ring      a ring of page-locked staging slots of RING_SLOT_BYTES, refilled by the host from the
            (memory-mapped, pageable) model file while the previous slot is on the link;
  pageable  copies straight from the model file: the driver stages them itself, synchronously.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import mmap
import threading

import numpy as np

from fermijit import FermijitError
from fermijit.jit import gpu_early
from fermijit.model.block_moe import BlockExperts
from fermijit.model.safetensors_io import madvise
from fermijit.model.weights import BlockTensor, QuantTensor
from fermijit.ops import moe

SOURCES = ("mapped", "pinned", "ring", "pageable")
RING_SLOTS = 3               # staging slots: one being filled, one on the link, one spare
RING_SLOT_BYTES = 64 << 20   # at most, per slot (less within a small --pin-budget)
REGION_ALIGN = 256           # bytes: where each array's region of a layer buffer starts
# The model file is registered in chunks of gpu_early.REGISTER_CHUNK_BYTES on REGISTER_THREADS
# threads (the measurements behind both there: it registers them at serve's exec too).


def routed_arrays(w) -> tuple[np.ndarray, ...]:
    """A layer's routed expert arrays [E, ...] as stored: Q4_0's gate_up qs, d, down qs, d; a
    block matrix's blocks."""
    if isinstance(w, moe.MoeWeights):
        return w.gate_up_qs, w.gate_up_d, w.down_qs, w.down_d
    if not isinstance(w, BlockExperts):
        raise FermijitError("the GPU prefill streams quantised experts only")
    out = []
    for m in (w.gate_up, w.down):
        out += [m.blocks] if isinstance(m, BlockTensor) else [m.qs, m.d]
    return tuple(out)


def expert_arrays(w) -> tuple[np.ndarray, ...]:
    """A layer's routed experts as [E, bytes] uint8 views (no copy), `routed_arrays`' order."""
    return tuple(np.asarray(a).reshape(a.shape[0], -1).view(np.uint8) for a in routed_arrays(w))


def with_arrays(w, views: list[np.ndarray]):
    """`w` (MoeWeights or BlockExperts) with its routed arrays replaced by `views` (as
    `routed_arrays` gives them)."""
    if isinstance(w, moe.MoeWeights):
        return dataclasses.replace(w, gate_up_qs=views[0], gate_up_d=views[1],
                                   down_qs=views[2], down_d=views[3])
    views, mats = list(views), {}
    for name in ("gate_up", "down"):
        m = getattr(w, name)
        if isinstance(m, BlockTensor):
            mats[name] = BlockTensor(m.kind, views.pop(0), m.in_perm)
        else:
            mats[name] = QuantTensor(m.kind, views.pop(0), views.pop(0))
    return dataclasses.replace(w, **mats)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Bytes of one expert in each array; E experts; the device buffer's regions."""

    per_expert: tuple[int, ...]
    n_experts: int

    @classmethod
    def of(cls, w) -> "Layout":
        arrays = expert_arrays(w)
        return cls(tuple(int(a.shape[1]) for a in arrays), int(arrays[0].shape[0]))

    @property
    def expert_bytes(self) -> int:
        return sum(self.per_expert)

    def _region(self, size: int) -> int:
        return -(-size * self.n_experts // REGION_ALIGN) * REGION_ALIGN

    @property
    def layer_bytes(self) -> int:
        return sum(self._region(size) for size in self.per_expert)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Start of each array's region in a layer buffer (REGION_ALIGN-aligned)."""
        starts = [0]
        for size in self.per_expert[:-1]:
            starts.append(starts[-1] + self._region(size))
        return tuple(starts)


def runs(needed: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs [a, b) of needed experts (needed: bool [E])."""
    inside = np.concatenate([[False], needed, [False]]).astype(np.int8)
    change = np.flatnonzero(np.diff(inside))
    return [(int(a), int(b)) for a, b in zip(change[::2], change[1::2])]


class Streamer:
    """Copies a layer's needed experts into a device buffer, group by group, on a copy stream."""

    def __init__(self, layers: list, source: str,
                 ring_slot_bytes: int = RING_SLOT_BYTES):
        from fermijit.jit import gpu

        if source not in SOURCES:
            raise FermijitError(f"expert source must be one of {SOURCES}, got {source!r}")
        # Per layer: a K-quant mix gives some layers' experts other formats (Q4_K_M: Q6_K down
        # projections in a third of the layers), so other sizes; the device buffers take the
        # largest layer.
        self.layouts = [Layout.of(w) for w in layers]
        self.layer_bytes = max(lay.layer_bytes for lay in self.layouts)
        self.host = [expert_arrays(w) for w in layers]
        self.addresses = [[a.ctypes.data for a in arrays] for arrays in self.host]
        self.stream = gpu.copy_stream()
        self.pool: list[np.ndarray] = []
        self.registered = None
        if source == "mapped":
            self.registered = _register_in_place(self.host)
            if self.registered is None:
                source = "pinned"
        gpu_early.release()  # serve's registration at exec: what was not adopted let go
        self.source = source
        # Where the registered chunks begin and end: the copies are cut there (`copy`).
        self.bounds = gpu.registered_bounds() if source == "mapped" else []
        if source == "pinned":
            for lay, arrays in zip(self.layouts, self.host):
                buf = gpu.pinned(lay.layer_bytes)
                for start, a in zip(lay.offsets, arrays):
                    buf[start:start + a.size] = a.reshape(-1)
                    _release_pages(a)  # as it goes: the RSS holds one copy plus one layer
                self.pool.append(buf)
        self.slot_bytes = ring_slot_bytes
        self.ring = ([gpu.pinned(ring_slot_bytes) for _ in range(RING_SLOTS)]
                     if source == "ring" else [])
        self.ring_events: list = [None] * len(self.ring)
        self._next_slot = 0
        self.bytes_copied = 0

    def rebind(self, layer: int, w):
        """`w` (layer `layer`'s experts as the CPU reads them) with its routed arrays in the
        page-locked pool (whose file pages were released as it was filled), so decode reads the
        one copy; `w` itself where the pool is not a copy."""
        if self.source != "pinned":
            return w
        buf, views = self.pool[layer], []
        for start, a in zip(self.layouts[layer].offsets, routed_arrays(w)):
            view = buf[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
            view.flags.writeable = False  # as the file's views: the same compiled kernels
            views.append(view)
        return with_arrays(w, views)

    def subset(self, layers: list[int]) -> "Streamer":
        """A view over those layers (in that order): the same stream, pool and ring (a ring
        slot's last event is the one either recorded: each waits for it before refilling)."""
        view = copy.copy(self)
        for name in ("layouts", "host", "addresses", "pool"):
            rows = getattr(self, name)
            setattr(view, name, [rows[i] for i in layers] if rows else rows)
        return view

    @property
    def pinned_bytes(self) -> int:
        registered = sum(r.nbytes for r in self.registered or ())
        return registered + sum(b.nbytes for b in self.pool) + sum(b.nbytes for b in self.ring)

    def copy(self, layer: int, experts: np.ndarray, device_base: int):
        """Issue the copies of `experts` (bool [E]) of `layer` into a layer buffer at
        `device_base`; returns an event recorded after them on the copy stream."""
        from fermijit.jit import gpu

        cuda = gpu.driver()
        lay, arrays = self.layouts[layer], self.host[layer]
        pieces = []  # (device address, host bytes)
        for a, b in runs(experts):
            for r, (start, size) in enumerate(zip(lay.offsets, lay.per_expert)):
                if self.source == "pinned":
                    src = self.pool[layer][start + a * size:start + b * size]
                else:
                    src = arrays[r][a:b].reshape(-1)
                first = self.addresses[layer][r] + a * size  # a copy reads from one chunk
                if (self.source == "mapped" and bisect.bisect_right(self.bounds, first)
                        < bisect.bisect_left(self.bounds, first + (b - a) * size)):
                    pieces += [(device_base + start + a * size + at, part)
                               for at, part in gpu.split_at_registrations(src, self.bounds)]
                else:
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


def _file_root(a: np.ndarray) -> np.ndarray | None:
    """The whole file mapping `a` is a view of (its np.memmap), or None."""
    root = None
    while a is not None:
        if isinstance(a, np.memmap):
            root = a
        a = getattr(a, "base", None)
    return root


def file_pieces(host: list[tuple[np.ndarray, ...]], chunk: int) -> list[tuple[int, int]] | None:
    """(address, bytes) pieces of at most `chunk` (whole pages) covering each model file mapping
    that holds the arrays of `host`; None where one is not a file view."""
    roots = [_file_root(a) for arrays in host for a in arrays]
    if any(r is None for r in roots):
        return None
    return [piece for root in {id(r): r for r in roots}.values()
            for piece in gpu_early.page_chunks(root.ctypes.data, root.nbytes, chunk)]


def _register_in_place(host: list[tuple[np.ndarray, ...]]) -> list | None:
    """Every model file holding experts registered with the driver as it is mapped, whole, in
    gpu_early.REGISTER_CHUNK_BYTES chunks (a copy from a range that only starts inside a
    registration fails: the LM head's scales beside the last expert did; copies are cut at the
    chunks' ends: gpu.split_at_registrations); None where the driver refuses (Fermi's drivers: no
    read-only registration; RLIMIT_MEMLOCK; not enough memory) or the experts are not file
    views."""
    from fermijit.jit import gpu

    pieces = file_pieces(host, gpu_early.chunk_bytes())
    if pieces is None:
        return None
    n_threads = min(len(pieces), gpu_early.register_threads())
    if n_threads == 1:
        held = []
        for at, n in pieces:
            registered = gpu.register(at, n)
            if registered is None:
                return None  # those registered already are unregistered as `held` goes
            held.append(registered)
        return held
    gpu.driver()  # the context made on this thread, before the others push it
    held: list = [None] * len(pieces)
    todo = iter(range(len(pieces)))
    lock = threading.Lock()

    def work() -> None:
        try:
            while True:
                with lock:
                    k = next(todo, None)
                if k is None:
                    return
                held[k] = gpu.register(*pieces[k])
        finally:
            gpu.release_thread()  # pycuda aborts on a thread that ends with a context pushed

    threads = [threading.Thread(target=work, name=f"fermijit-register-{n}", daemon=True)
               for n in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return None if any(r is None for r in held) else held


def _release_pages(a: np.ndarray) -> None:
    """Drop this process's mapping of the whole pages inside `a` (a view of the model file: the
    page cache keeps the data, the RSS loses it; a later read would fault it back in)."""
    page = mmap.PAGESIZE
    first = -(-a.ctypes.data // page) * page
    last = (a.ctypes.data + a.nbytes) // page * page
    if last > first and _file_root(a) is not None:
        madvise(first, last - first, MADV_DONTNEED)


MADV_DONTNEED = 4  # linux/mman.h
