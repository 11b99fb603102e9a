"""The GPU prefill's state on the device and back: the host `State`'s KV caches and GDN states
sent in before a prefill (fermijit/prefill/gpu_prefill.py) and handed back after it, for the
CPU's decode.

The device's KV caches are fp32. A host cache of Q8_0 rows (ops/kv_quant.py) is sent in
dequantised, and the new rows are rounded to Q8_0 on the GPU before the hand-off
(ops/act_quant.py: the CPU's rounding), so the copy back is the codes and scales (0.28x fp32's
bytes)."""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import TYPE_CHECKING

import numpy as np

from fermijit.model.state import GdnState, KvCache, State
from fermijit.ops.kv_quant import Q8Rows
from fermijit.ops.quant import BLOCK
from fermijit.prefill.gpu_layout import F32

if TYPE_CHECKING:
    from fermijit.prefill.gpu_prefill import DeviceModel

# Threads copying the handed-off state into the host `State` (~100 MB at full size, 24 ms on
# one thread of the H200's host).
COPY_THREADS = 4


# Floats (256 bytes) where each array starts in a sequence's device block (`upload_states`): the
# pool's own alignment, so the kernels see the addresses separate allocations had.
DEVICE_ALIGN = 64


class DeviceStates(list):
    """`upload_states`' device states per layer, with `kv_block`: the one device allocation their
    KV caches are views of (None without attention layers), which the hand-off rounds to Q8_0 in
    one launch."""

    kv_block = None


def upload_states(state: State, n_positions: int) -> DeviceStates:
    """The host state on the device: KV caches with room for `n_positions` holding the
    state's positions, GDN states (and the MTP head's cache, last, where the state has it: its
    row at position - 1 is sent too, unwritten yet, and the prefill writes it first). They are
    views of two device allocations, the GDN states' (the same size every call: the pool's
    same block again) and the KV caches': a state at position 0 is the empty one
    (Model.new_state), whose GDN states are cleared by one memset, not sent (~100 MB for the
    full-size shapes). (An allocation and a memset per array cost ~5 ms a sequence on the
    H200's host: 8 prompts prefilled together spent 0.03-0.12 s sending states in.)"""
    from fermijit.jit import gpu

    cuda, held = gpu.driver(), state.position
    shapes = [[(a.shape[0], n_positions, a.shape[2]) for a in (s.k, s.v)]
              if isinstance(s, KvCache) else [s.conv.shape, s.recurrent.shape]
              for s in state.layers]

    def floats(shape) -> int:
        return -(-int(np.prod(shape)) // DEVICE_ALIGN) * DEVICE_ALIGN

    states, blocks = DeviceStates(), {}
    at = {False: 0, True: 0}  # by is-a-KV-cache: the next free float
    with gpu.check("sending the state in"):
        for is_kv in (False, True):
            n = sum(floats(x) for s, pair in zip(state.layers, shapes)
                    if isinstance(s, KvCache) == is_kv for x in pair)
            if n:
                blocks[is_kv] = gpu.empty((n,))
                if not (is_kv or held):
                    cuda.memset_d32(blocks[is_kv].gpudata, 0, n)
        for s, pair in zip(state.layers, shapes):
            is_kv, views = isinstance(s, KvCache), []
            for shape in pair:
                start = at[is_kv]
                at[is_kv] += floats(shape)
                views.append(blocks[is_kv][start:start + int(np.prod(shape))].reshape(shape))
            if is_kv:
                for a, dev in zip((s.k, s.v), views):
                    heads, _, dim = a.shape
                    for h in range(heads if held else 0):
                        rows = a[h, :held]
                        rows = (rows.dequantize() if isinstance(rows, Q8Rows)
                                else np.ascontiguousarray(rows))
                        cuda.memcpy_htod(int(dev.gpudata) + h * n_positions * dim * F32, rows)
                states.append(KvCache(*views))
            else:
                for a, dev in zip((s.conv, s.recurrent), views):
                    if held:
                        cuda.memcpy_htod(int(dev.gpudata), np.ascontiguousarray(a, np.float32))
                states.append(GdnState(*views))
    states.kv_block = blocks.get(True)
    return states


def handed_rows(state: State, end: int) -> list[tuple[int, int]]:
    """Per layer, the positions [a, b) of its KV rows the hand-off writes: the state's position
    to `end`; the MTP head's cache (the last layer, where `state.hidden` is set) lags one
    position (model/mtp.py): from its first waiting hidden state's position to end - 1."""
    rows = [(state.position, end)] * len(state.layers)
    if state.hidden is not None:
        rows[-1] = (state.position - state.hidden.shape[0], end - 1)
    return rows


def handed_arrays(state: State, end: int) -> list[list[np.ndarray]]:
    """Per layer, the host arrays the hand-off writes (contiguous): each head's KV rows
    (`handed_rows`: k's heads, then v's; a Q8_0 row range as its codes then its scales), the
    GDN conv and recurrent states."""
    def head_rows(a, h, start, stop):
        rows = a[h, start:stop]
        return [rows.qs, rows.d] if isinstance(rows, Q8Rows) else [rows]

    return [[x for a in (s.k, s.v) for h in range(a.shape[0]) for x in head_rows(a, h, *rows)]
            if isinstance(s, KvCache) else [s.conv, s.recurrent]
            for s, rows in zip(state.layers, handed_rows(state, end))]


def _q8_block(block) -> tuple:
    """A sequence's KV block (`DeviceStates.kv_block`: every KV cache of it, each on
    DEVICE_ALIGN floats, a multiple of the 32-block) rounded to Q8_0 on the GPU in place, in ONE
    launch (its blocks are rounded alone: the same codes and scales as a launch per cache, ~20
    of them a sequence at full size: 0.03-0.12 s of an 8-prompt batch's hand-off on the H200);
    returns its (codes, scales) device arrays."""
    from fermijit.ops import act_quant

    _, codes, scales = act_quant.gpu(block, out=block, codes=True)
    return codes, scales


def _q8_block_sources(dev_rows, start: int, block, rounded: tuple) -> list[int]:
    """The addresses of each head's codes, then scales, from `start`, of a device cache [heads,
    positions, dim] inside `block`, rounded by `_q8_block` into `rounded` (codes, scales)."""
    heads, positions, dim = dev_rows.shape
    at = (int(dev_rows.gpudata) - int(block.gpudata)) // F32  # its first float in the block
    codes, scales = rounded
    return [address for h in range(heads) for first in [at + (h * positions + start) * dim]
            for address in (int(codes.gpudata) + first,
                            int(scales.gpudata) + first // BLOCK * F32)]


def hand_off(dev: DeviceModel, sequences: list[tuple], timings: dict | None = None) -> None:
    """Each sequence's (device states, host `State`, end, waiting) device caches (the positions
    from the host state's to `end`: `handed_rows`) and states into the host state, which then
    holds `end` positions; with the MTP head, `waiting` (device [1, H]) becomes its hidden state
    waiting (else None). Everything is read back (into one page-locked buffer: DMA at the link's
    rate) before any host state changes, so a failure leaves them all as they were; but for a
    new state's (position 0) GDN arrays in page-locked memory (the server's pool:
    fermijit/server/state_pool.py), which the DMA writes in place (no host copy), and which a
    failure sets back to the zeros they were. `timings` (a dict) gets the host seconds of its
    steps: the rows' rounding (the launches, and their end), the copies (their calls and the
    DMA's end), the host copy out of the hand-off buffer (run_batch's --verbose phases)."""
    import time

    from fermijit.jit import gpu

    clock = [time.perf_counter()]

    def step(name: str) -> None:
        clock.append(time.perf_counter())
        if timings is not None:
            timings[name] = clock[-1] - clock[-2]

    cuda = gpu.driver()
    pieces = []  # (host array to fill, device address), in handed_arrays' order
    direct = []  # (a new state's page-locked GDN array, device address): written in place
    held = []    # the rounded caches' device arrays, alive until copied
    hidden = []  # the waiting hidden states' host arrays, or None
    for states, state, end, waiting in sequences:
        rounded = None
        if any(isinstance(s, KvCache) and isinstance(s.k, Q8Rows) for s in state.layers):
            # a state's caches are all of one kind, in one KV block (upload_states): rounded
            # in place, one launch
            with gpu.check("rounding the KV cache to Q8_0"):
                rounded = _q8_block(states.kv_block)
            held.append(rounded)
        for d, s, host, (start, _) in zip(states, state.layers, handed_arrays(state, end),
                                          handed_rows(state, end)):
            if isinstance(d, KvCache) and rounded is not None:
                sources = [a for x in (d.k, d.v)
                           for a in _q8_block_sources(x, start, states.kv_block, rounded)]
                # in handed_arrays' order: k's heads (codes, scales each), then v's
            elif isinstance(d, KvCache):
                heads, positions, dim = d.k.shape
                sources = [int(x.gpudata) + (h * positions + start) * dim * F32
                           for x in (d.k, d.v) for h in range(heads)]
            else:
                sources = [int(d.conv.gpudata), int(d.recurrent.gpudata)]
                if state.position == 0 and all(gpu.is_pinned(a) for a in host):
                    direct += zip(host, sources)
                    continue
            pieces += zip(host, sources)
        hidden.append(None if waiting is None else np.empty(waiting.shape, np.float32))
        if waiting is not None:
            pieces.append((hidden[-1], int(waiting.gpudata)))
    buf = dev.host_buffer("state", sum(a.nbytes for a, _ in pieces))
    if held:  # the rounding ran on the legacy stream; the copies go on another
        with gpu.check("rounding the KV cache to Q8_0"):
            cuda.Context.synchronize()
    step("rounding")
    try:
        with gpu.check("copying the state back"):
            at = 0
            for a, address in pieces:
                cuda.memcpy_dtoh_async(buf[at:at + a.nbytes], address, dev.readback)
                at += a.nbytes
            for a, address in direct:
                cuda.memcpy_dtoh_async(a, address, dev.readback)
            dev.readback.synchronize()
    except BaseException:
        with contextlib.suppress(Exception):  # no copy still landing
            dev.readback.synchronize()
        for a, _ in direct:
            a.fill(0)
        raise
    step("copies")
    fill_from(buf, [a for a, _ in pieces])
    step("host copy")
    for (_, state, end, _), h in zip(sequences, hidden):
        state.position = end
        if h is not None:
            state.hidden = h


def fill_from(buf: np.ndarray, arrays: list[np.ndarray]) -> None:
    """Each of `arrays` (host, contiguous) from its bytes of `buf` (uint8), in order: the
    hand-off's copy out of its page-locked buffer, on COPY_THREADS threads."""
    starts = np.cumsum([0] + [a.nbytes for a in arrays])

    def fill(n: int) -> None:
        a = arrays[n]
        a[...] = buf[starts[n]:starts[n + 1]].view(a.dtype).reshape(a.shape)

    if COPY_THREADS > 1:                # numpy's copies release the GIL
        with concurrent.futures.ThreadPoolExecutor(COPY_THREADS) as pool:
            list(pool.map(fill, range(len(arrays))))
    else:
        for n in range(len(arrays)):
            fill(n)
