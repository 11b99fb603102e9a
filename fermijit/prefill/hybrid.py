"""Which device prefills a prompt, and how the GPU prefill fits its memory.

A `Prefiller` is chosen once per run (`make`) and called once per prompt:
`prefill(tokens, state, on_block=None, all_logits=False) -> logits`, updating `state` as
`Model.prefill` does, so decode continues on the CPU from it (and a prefix cache can wrap it);
or, for several sequences at once (the server's prompts that arrive together, and the chunks of
a long one: fermijit/server/scheduler.py), `prefill_batch(items, align) -> [logits]`.

  cpu   Model.prefill / Model.prefill_batch (W4A8 GEMMs on the CPU).
  gpu   fermijit/prefill/gpu_prefill.py: dense weights resident on the GPU, routed experts streamed
        from page-locked host memory (fermijit/prefill/expert_stream.py), the state handed back to
        the host; a batch's sequences in one pass over all their rows (the experts fetched once for
        them), and the MTP head's rows in the same pass where the states have it (model/mtp.py).
  auto  gpu for prompts of at least AUTO_MIN_TOKENS tokens, cpu for shorter ones; the default.

The GPU path falls back to the CPU, with one line on stderr, whenever it cannot run: no pycuda,
no device, a model it cannot take, a driver error or too little GPU memory (auto says nothing
when there is no GPU at all: a machine without one is its ordinary case). It reads the host
state and writes it back only when the whole pass has succeeded, so a failed attempt leaves the
state as it was and the CPU prefill starts from it.

Memory plan (`plan`): resident dense weights + one layer's expert buffer + KV caches and GDN
states + one pass's activations must fit `--gpu-mem`; when the whole prompt's activations do not,
the prompt runs in chunks of the largest size that fits (said on stderr).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import re
import sys
import threading
import time

import numpy as np

from fermijit import FermijitError

MIB, GIB = 1 << 20, 1 << 30
GPU_MEM_MARGIN = 512 * MIB  # default --gpu-mem is free memory less this (pool rounding, context)
POOL_SLACK = 1.25           # pycuda's memory pool rounds each allocation up by at most a quarter
MIN_CHUNK = 64              # tokens: the GEMM tile height; below it a chunk wastes its tiles
PIN_FRACTION = 0.5          # default --pin-budget: this share of the host's RAM
# auto: prompts at least this long prefill on the GPU. The crossover measured on the H200
# machine (bench prefill --sweep, best of 3): the default model, CPU 15.7 / GPU 18.8 ms at 16
# tokens, 23.0 / 18.6 ms at 32; the REAP-128 shape's GPU prefill is already 11x faster at 8
# tokens (0.25 against 2.74 s), so the small model's crossover is the one that binds.
AUTO_MIN_TOKENS = 32
# GpuPrefiller.reserve: the prompt length each sequence's hand-off room is made for (the state's
# size is nearly all GDN state at full size: a prompt's KV rows are ~12 KB a token in Q8_0).
RESERVE_TOKENS = 512
MODES = ("cpu", "gpu", "auto")


def parse_bytes(text: str | int | None) -> int | None:
    """'6G', '512M', '1.5GiB', '4096' (bytes) -> bytes; None stays None."""
    if text is None or isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*", str(text), re.I)
    nbytes = float("inf")
    if match:
        nbytes = float(match.group(1)) * (1 << (10 * " kmgt".index(match.group(2).lower() or " ")))
    if nbytes == float("inf"):  # 309+ digits too: int() raised OverflowError (a traceback)
        raise FermijitError(f"not a size: {text!r} (e.g. 6G, 512M, 1.5GiB)")
    return int(nbytes)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How one prompt runs on the GPU (bytes)."""

    n_tokens: int
    chunk: int                # tokens per pass
    budget: int               # --gpu-mem
    resident: int             # dense weights, final norm, LM head (when Q4_0)
    expert_buffer: int        # two layers' routed experts (all E each, the routed ones filled)
    streamed_per_layer: int   # bytes of all E experts of a layer: the most a layer copies
    states: int               # KV caches for the prompt's positions, GDN states
    activations: int          # one pass of `chunk` tokens, with the pool's rounding
    source: str               # pinned | ring (expert_stream.SOURCES)
    pinned: int               # page-locked host bytes

    @property
    def total(self) -> int:
        return self.resident + self.expert_buffer + self.states + self.activations

    @property
    def n_chunks(self) -> int:
        return -(-self.n_tokens // self.chunk)

    def describe(self) -> str:
        mib = lambda n: f"{n / MIB:,.1f} MiB"  # noqa: E731
        return "\n".join([
            f"gpu prefill plan: {self.n_tokens} tokens in {self.n_chunks} pass(es) of "
            f"<= {self.chunk}; budget {mib(self.budget)}, planned {mib(self.total)}",
            f"  resident dense weights   {mib(self.resident)}",
            f"  expert buffers (2 lay.)  {mib(self.expert_buffer)}",
            f"  streamed per layer       <= {mib(self.streamed_per_layer)} (routed experts only)",
            f"  KV caches + GDN states   {mib(self.states)}",
            f"  activations per pass     {mib(self.activations)}",
            f"  experts from             {self.source} host memory ({mib(self.pinned)} "
            f"page-locked)"])


def ring_slot_bytes(pin_budget: int) -> int:
    """Staging slots of the ring within `pin_budget`: at most RING_SLOT_BYTES, at least 1 MiB."""
    from fermijit.prefill import expert_stream

    return max(MIB, min(expert_stream.RING_SLOT_BYTES, pin_budget // expert_stream.RING_SLOTS))


def default_pin_budget() -> int:
    return int(PIN_FRACTION * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def plan(model, n_tokens: int, start: int, budget: int, pin_budget: int,
         all_logits: bool = False, resident: int | None = None,
         ends: list[int] | None = None, with_head: bool = False) -> Plan:
    """The memory plan of a prefill of `n_tokens` after `start` positions; FermijitError when
    even a pass of MIN_CHUNK tokens does not fit `budget`. Needs no GPU. `resident`: the dense
    weights' bytes when known (DeviceModel.resident_bytes; counting them builds the joined
    arrays again: 4 ms a prefill at full size, measured on the H200's host). Several sequences
    together (`prefill_batch`): `n_tokens` all their rows, `ends` each one's end position (their
    states are all on the device; default one, start + n_tokens). `with_head`: the states have
    the MTP head (its cache, its rows' activations)."""
    from fermijit.model.reap import moe_layers
    from fermijit.prefill import expert_stream, gpu_layout

    if resident is None:
        resident = sum(a.nbytes for layer in gpu_layout.dense_arrays(model)
                       for a in layer.values())
        resident += model.norm.nbytes + gpu_layout.head_bytes(model)
    # per layer: a K-quant mix's layers differ (expert_stream.Streamer.layouts)
    layer_bytes = [expert_stream.Layout.of(w.experts).layer_bytes for w in moe_layers(model)]
    largest = max(layer_bytes)
    ends = [start + n_tokens] if ends is None else ends
    states = sum(gpu_layout.state_bytes(model, end, with_head) for end in ends)
    fixed = resident + 2 * largest + states  # the expert buffer pair

    def activations(t: int) -> int:
        logits = 4 * model.vocab_size * (t if all_logits else min(t, len(ends)))
        return int(POOL_SLACK * (gpu_layout.activation_bytes(model, t, with_head) + logits))

    chunk = n_tokens  # else the largest multiple of MIN_CHUNK that fits
    if fixed + activations(chunk) > budget:
        chunk = max(MIN_CHUNK, (n_tokens - 1) // MIN_CHUNK * MIN_CHUNK)
        while fixed + activations(chunk) > budget and chunk > MIN_CHUNK:
            chunk -= MIN_CHUNK
    if fixed + activations(chunk) > budget:
        raise FermijitError(f"the GPU prefill needs {(fixed + activations(chunk)) / MIB:,.0f} "
                            f"MiB of GPU memory, the budget is {budget / MIB:,.0f} MiB")
    pool = sum(layer_bytes)
    source = "pinned" if pool <= pin_budget else "ring"
    pinned = pool if source == "pinned" else expert_stream.RING_SLOTS * ring_slot_bytes(pin_budget)
    return Plan(n_tokens, chunk, budget, resident, 2 * largest, largest, states,
                activations(chunk), source, pinned)


# Tokens a server prefills between two decode steps of its running streams (the scheduler's
# chunk; fermijit/server/scheduler.py), on the CPU: the prefix cache's pass (SNAPSHOT_EVERY),
# so that with the cache on (the server's default) chunking costs the prefill nothing, while a
# stream's longest wait for a token is one such pass. Shorter passes cost throughput, longer
# ones only lengthen that wait (the time share, not the chunk, sets the streams' rate). Measured
# (2 threads, a 2-core machine at load 10-12, medians of 5): the default model 260-307 tok/s in
# passes of 128, 342-373 of 256, 429-516 of 512 (two runs); an 8-layer REAP-128 slice 27, 43
# and 54 tok/s (one run).
CPU_CHUNK_TOKENS = 256


@dataclasses.dataclass
class PrefillItem:
    """One sequence of a `prefill_batch` call."""

    tokens: np.ndarray            # int32 [T]: to prefill after the state's position
    state: object                 # model.state.State, advanced by the call
    on_block: object = None       # on_block(n) after each pass that fed n of these tokens


class CpuPrefiller:
    name = "cpu"
    chunk_tokens = CPU_CHUNK_TOKENS
    runs_beside_decode = False

    def __init__(self, model):
        self.model = model
        # Prompt tokens prefilled per device ("cpu", "gpu"): the server's /health shows them.
        self.n_prefilled = collections.Counter()

    def prepare(self) -> bool:
        """Nothing to set up: `engine.warm_up` compiles the CPU kernels."""
        return True

    def prefill(self, tokens, state, on_block=None, all_logits: bool = False,
                align: int | None = None) -> np.ndarray:
        """Model.prefill: passes end at multiples of `align` (the prefix cache snapshots there)."""
        self.n_prefilled["cpu"] += np.size(tokens)
        return self.model.prefill(tokens, state, all_logits=all_logits, on_block=on_block,
                                  align=align)

    def prefill_batch(self, items: list[PrefillItem], align: int | None = None) -> list:
        """Model.prefill_batch: one forward a pass over all the items' rows, each item's logits
        and state bit for bit its `prefill` alone."""
        def on_block(b: int, n: int) -> None:
            if items[b].on_block is not None:
                items[b].on_block(n)

        return self.model.prefill_batch([i.tokens for i in items], [i.state for i in items],
                                        on_block=on_block, align=align)


class GpuPrefiller:
    """The GPU prefill; falls back to `cpu` (one line on `err`) when the GPU cannot do it, and
    stays on the CPU after a driver error."""

    name = "gpu"
    # The scheduler gives a GPU prefill whole prompts (each call hands the state in and out),
    # on a thread of their own while its streams go on decoding on the CPU.
    chunk_tokens = None
    runs_beside_decode = True

    def __init__(self, model, gpu_mem: int | None = None, pin_budget: int | None = None,
                 verbose: bool = False, err=None, source: str | None = None, w4a8: bool = True,
                 is_quiet_without_gpu: bool = False):
        self.model = model
        # auto: no GPU at all (no pycuda, no device) is said nowhere; other failures are.
        self.is_quiet_without_gpu = is_quiet_without_gpu
        # The GEMMs' inputs rounded to 8 bits as the CPU prefill rounds them (gpu_prefill's
        # numerics: the all-CPU run's, to fp32 rounding and its 8-bit flips); False: fp32.
        self.w4a8 = w4a8
        self.cpu = CpuPrefiller(model)
        self.n_prefilled = self.cpu.n_prefilled
        self.gpu_mem, self.pin_budget = gpu_mem, pin_budget
        self.verbose, self.err = verbose, err or sys.stderr
        self.source = source          # None: as the plan says (pinned within --pin-budget)
        self.device = None            # gpu_prefill.DeviceModel, made by prepare()
        self.broken: str | None = None
        self.last_plan: Plan | None = None
        self.last_pass = None
        # REAP calibration (model/reap.py): called as observer(layer, experts, weights, norms)
        # per layer of each pass, once the whole prefill has succeeded (so a fallback to the CPU
        # never counts a token twice).
        self.observer = None
        # Page-locked host buffers by name (the DeviceModel's, made here where reserved ahead).
        self.host_buffers: dict[str, np.ndarray] = {}
        # Set once prepare() has the driver up (or has failed); `on_driver()` is then called on
        # its thread (hybrid.preparing: the server's page-locking ahead, beside the rest).
        self.driver_up = threading.Event()
        self.on_driver = None
        # Where set (hybrid.preparing, PASS_AFTER_ENV), the 2-token pass waits for it.
        self.pass_gate: threading.Event | None = None

    def _say(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    def _fall_back(self, reason: str) -> None:
        self.broken = reason
        self._say(f"gpu prefill unavailable, prefilling on the CPU: {reason}")

    def budget(self) -> int:
        from fermijit.jit import gpu

        if self.gpu_mem is not None:
            return self.gpu_mem
        free, _ = gpu.memory()
        return max(0, free - GPU_MEM_MARGIN)

    def prepare(self) -> bool:
        """Upload the dense weights, page-lock the experts, load the kernels (a two-token pass on
        a throwaway state); False (said once) when the GPU cannot be used."""
        if self.broken is not None:
            return False
        if self.device is not None:
            return True
        from fermijit.jit import gpu_early

        try:
            return self._prepare_or_fall_back()
        finally:
            gpu_early.release()  # serve's registration at exec, what nothing adopted let go

    def _prepare_or_fall_back(self) -> bool:
        from fermijit.jit import gpu

        reason = gpu.unavailable_reason()
        if reason is not None and self.is_quiet_without_gpu:
            self.broken = f"no GPU: {reason}"
            return False
        try:
            if reason is not None:
                raise FermijitError(f"no GPU: {reason}")
            self._prepare()
            return True
        except Exception as e:  # noqa: BLE001 - pycuda's errors are not FermijitErrors
            self._fall_back(one_line(e))
            return False
        finally:
            self.driver_up.set()

    def driver_ready(self) -> bool:
        """Whether page-locked host memory can be had: the driver is up (prepare() may still be
        loading the rest on another thread), else prepare() here; False where the GPU cannot be
        used."""
        if self.driver_up.is_set() and self.broken is None:
            return True
        return self.prepare()

    def _prepare(self) -> None:
        from fermijit.jit import gpu
        from fermijit.prefill import gpu_prefill

        start = time.perf_counter()
        budget = self.gpu_mem = self.budget()  # free memory now, before our own allocations
        pin_budget = default_pin_budget() if self.pin_budget is None else self.pin_budget
        first = plan(self.model, 2, 0, budget, pin_budget)  # checks the model and the budget
        driver_s = time.perf_counter() - start
        self.driver_up.set()
        if self.on_driver is not None:
            self.on_driver()
        self.device = gpu_prefill.DeviceModel(self.model, self.source or first.source,
                                              ring_slot_bytes(pin_budget), self.host_buffers)
        gate, self.pass_gate = self.pass_gate, None
        if gate is not None:
            waited = time.perf_counter()
            gate.wait()
            self.device.prepare_s["waited for the CPU"] = time.perf_counter() - waited
        # On one layer of each kind (DeviceModel.sample): the same modules loaded.
        whole = os.environ.get(GPU_WARM_WHOLE_ENV) == "1"
        sample = self.device if whole else self.device.sample()
        warm = sample.model.new_state(2)
        observer, self.observer = self.observer, None     # the warm-up pass is not calibration
        start, modules = time.perf_counter(), gpu.module_load_s
        try:
            self.run(np.zeros(2, np.int32), warm, device=sample)
        finally:
            self.observer = observer
        # Seconds per part of the start (`--verbose`; issue 28 item 4's start-up budget).
        self.prepare_s = {"driver": driver_s, **self.device.prepare_s,
                          "kernels (2-token pass)": time.perf_counter() - start,
                          "of which module loads": gpu.module_load_s - modules,
                          **{f"2-token pass: {k}": v for k, v in self.last_phases.items()
                             if not k.startswith("of which")}}
        if self.verbose:
            self._say("gpu prefill ready: " + ", ".join(f"{k} {v:.2f} s"
                                                        for k, v in self.prepare_s.items()))

    def reserve(self, n_sequences: int, n_tokens: int = RESERVE_TOKENS) -> None:
        """Page-lock the hand-off buffer for `n_sequences` prompts of `n_tokens` prefilled
        together, now (the server calls this once ready, before its first request). Grown inside
        a pass instead, the page-locking (~0.25 s for 8 full-size states of ~65 MB) fell on the
        server's first batch of prompts: 8 concurrent 64-token prompts' last first token 2.76x one
        prompt's, 1.80x for every later batch (H200, reap128)."""
        if not self.driver_ready():
            return
        from fermijit.prefill import gpu_prefill

        try:  # before the device model where the driver is up already (page-locked ahead)
            gpu_prefill.host_buffer(self.host_buffers, "state",
                                    n_sequences * self.model.state_nbytes(n_tokens))
        except Exception as e:  # noqa: BLE001 - then the first batch page-locks it, as before
            self._say(f"gpu prefill: no room reserved for {n_sequences} prompts' states: "
                      f"{one_line(e)}")

    def host_memory(self, nbytes: int) -> np.ndarray:
        """`nbytes` (uint8) of page-locked host memory where the GPU is usable, else ordinary:
        the server's GDN states there (fermijit/server/state_pool.py) are written in place by the
        hand-off's DMA (gpu_state.hand_off)."""
        if self.driver_ready():
            from fermijit.jit import gpu

            try:
                return gpu.pinned(nbytes)
            except Exception as e:  # noqa: BLE001 - then the hand-off copies, as before
                self._say(f"gpu prefill: states not page-locked: {one_line(e)}")
        return np.empty(nbytes, np.uint8)

    def prefill(self, tokens, state, on_block=None, all_logits: bool = False,
                align: int | None = None) -> np.ndarray:
        """One pass over the whole prompt (unless it is chunked for memory): `align` is not
        followed, so the prefix cache snapshots a GPU prefill at its end only."""
        tokens = np.asarray(tokens, dtype=np.int32)
        if not self.prepare():
            return self.cpu.prefill(tokens, state, on_block, all_logits, align)
        self._check(tokens, state)
        return self._gpu_or_cpu(
            [PrefillItem(tokens, state, on_block)], all_logits,
            lambda: [self.cpu.prefill(tokens, state, on_block, all_logits)])[0]

    def _gpu_or_cpu(self, items: list[PrefillItem], all_logits: bool, cpu) -> list:
        """`run_batch(items)`; where the GPU path fails: said, the GPU given up, and `cpu()`
        instead, from the states as they were (run_batch hands them back all or none)."""
        positions = [i.state.position for i in items]
        try:
            logits = self.run_batch(items, all_logits)
        except Exception as e:  # noqa: BLE001 - pycuda's errors are not FermijitErrors
            if [i.state.position for i in items] != positions:
                raise  # after the hand-off: an on_block's or the observer's, not the GPU's
            self._fall_back(one_line(e))
            self.device = None
            return cpu()
        self.n_prefilled["gpu"] += sum(i.tokens.size for i in items)
        return logits

    def _check(self, tokens: np.ndarray, state) -> None:
        """Bad input as the CPU's prefill says it (a FermijitError before any GPU work)."""
        if tokens.ndim != 1 or tokens.size == 0:
            raise FermijitError(f"prefill needs a non-empty 1-D token array, got shape "
                                f"{list(tokens.shape)}")
        if tokens.min() < 0 or tokens.max() >= self.model.vocab_size:
            raise FermijitError(f"token ids must be in [0, {self.model.vocab_size}), got "
                                f"[{tokens.min()}, {tokens.max()}]")
        self.model._check_room(state, tokens.size)

    def prefill_batch(self, items: list[PrefillItem], align: int | None = None) -> list:
        """Prefill each item's tokens after its state; the logits [V] after each item's last
        token, in the items' order. The contract:
        - every item's state ends as `prefill` of it alone leaves it: KV rows, GDN conv and
          recurrent state, the MTP head's rows and waiting hidden state, position advanced by its
          tokens; its logits within the tolerance the GPU holds to the CPU's;
        - `item.on_block(n)` after each pass that fed n of its tokens, once the host state holds
          them: the states are handed back at the end of a `run_batch` call, so then;
        - a failure falls back to the CPU (one line, as `prefill`) for the items not yet done,
          from their states as they were before (a `run_batch` call hands its states back all
          or none); bad input (token ids, room) is a FermijitError.
        One `run_batch` call (one or more passes over all their rows) per group of `_groups`.
        `align` is not followed, as in `prefill`."""
        items = [dataclasses.replace(i, tokens=np.asarray(i.tokens, np.int32)) for i in items]
        if len({id(i.state) for i in items}) != len(items):
            raise FermijitError("prefill_batch: a state appears twice")
        if not self.prepare():
            return self.cpu.prefill_batch(items, align)
        for i in items:
            self._check(i.tokens, i.state)
        logits = [None] * len(items)
        for group in self._groups(items):
            mine = [items[k] for k in group]
            on_cpu = lambda: self.cpu.prefill_batch(mine, align)  # noqa: E731
            rows = on_cpu() if self.broken else self._gpu_or_cpu(mine, False, on_cpu)
            for k, row in zip(group, rows):
                logits[k] = row
        return logits

    def _groups(self, items: list[PrefillItem]) -> list[list[int]]:
        """The items' indices by `run_batch` call: those whose states have the MTP head apart
        from the others, and in each call as many items as the memory plan takes (all their
        states on the device at once; an item alone that does not fit fails in its call)."""
        from fermijit.model import mtp

        groups = []
        for with_head in (False, True):
            mine = [k for k, item in enumerate(items)
                    if mtp.has_head(self.model, item.state) == with_head]
            if len(mine) > 1 and self._fits([items[k] for k in mine], with_head):
                groups.append(mine)  # all in one call: one plan (~2 ms each at full size)
                continue
            group: list[int] = []
            for k in mine:
                if group and not self._fits([items[j] for j in group + [k]], with_head):
                    groups.append(group)
                    group = []
                group.append(k)
            if group:
                groups.append(group)
        return groups

    def _plan(self, items: list[PrefillItem], with_head: bool, all_logits: bool = False,
              device=None) -> Plan:
        device = device or self.device
        pin_budget = default_pin_budget() if self.pin_budget is None else self.pin_budget
        return plan(device.model, sum(i.tokens.size for i in items), items[0].state.position,
                    self.budget(), pin_budget, all_logits, device.resident_bytes,
                    [i.state.position + i.tokens.size for i in items], with_head)

    def _fits(self, items: list[PrefillItem], with_head: bool) -> bool:
        try:
            self._plan(items, with_head)
            return True
        except FermijitError:
            return False

    def run(self, tokens, state, all_logits: bool = False, on_block=None,
            time_layers: bool = False, profile: bool = False, device=None):
        """The GPU prefill of one sequence: `run_batch` of it alone."""
        return self.run_batch([PrefillItem(tokens, state, on_block)], all_logits, time_layers,
                              profile, device)[0]

    def run_batch(self, items: list[PrefillItem], all_logits: bool = False,
                  time_layers: bool = False, profile: bool = False, device=None) -> list:
        """The GPU prefill itself, no fallback (`prefill_batch` checks the input and falls
        back): the items' rows in passes of at most the plan's chunk (gpu_prefill.Pass, each
        item a Segment), their states sent in first and handed back at the end; each item's
        logits [V] ([T, V] with `all_logits`, for one item). The states have the MTP head all or
        none (`_groups`). `time_layers` and `profile` keep CUDA events for `bench prefill` in
        `last_pass`. `device`: a view of the device model (DeviceModel.sample) to run on."""
        from fermijit.jit import gpu
        from fermijit.model import mtp
        from fermijit.prefill import gpu_prefill, gpu_state

        clock, modules = [time.perf_counter()], gpu.module_load_s
        phases = self.last_phases = {}           # host seconds per phase (bench --verbose)

        def phase(name: str) -> None:
            clock.append(time.perf_counter())
            phases[name] = phases.get(name, 0.0) + clock[-1] - clock[-2]

        device = device or self.device
        model = device.model
        with_head = mtp.has_head(model, items[0].state)
        if any(mtp.has_head(model, i.state) != with_head for i in items):
            raise FermijitError("run_batch: the states have the MTP head all or none")
        if all_logits and len(items) > 1:
            raise FermijitError("run_batch: all_logits takes one sequence")
        n_rows = sum(i.tokens.size for i in items)
        p = self.last_plan = self._plan(items, with_head, all_logits, device)
        if self.verbose and n_rows > 2:
            self._say(p.describe())
        if p.n_chunks > 1:
            self._say(f"gpu prefill: activations of {n_rows} tokens exceed --gpu-mem; "
                      f"{p.n_chunks} passes of <= {p.chunk} tokens")
        phase("plan")
        ends = [i.state.position + i.tokens.size for i in items]
        states = [gpu_state.upload_states(i.state, end) for i, end in zip(items, ends)]
        waiting = [_waiting(model, i.state) if with_head else None for i in items]
        phase("state in")
        done = [0] * len(items)
        logits: list = [[] if all_logits else None for _ in items]
        fed, observed = [], []  # (item, tokens) per pass; REAP's observations
        while any(d < i.tokens.size for d, i in zip(done, items)):
            run = self.last_pass = None  # the last pass's buffers freed before the next's
            segments, pieces, row = [], [], 0
            for b, item in enumerate(items):
                n = min(item.tokens.size - done[b], p.chunk - row)
                if n > 0:
                    segments.append(gpu_prefill.Segment(slice(row, row + n),
                                                        item.state.position + done[b],
                                                        states[b], waiting[b]))
                    pieces.append((b, n))
                    row += n
            run = gpu_prefill.Pass(device, segments, observe=self.observer is not None,
                                   w4a8=self.w4a8)
            run.marks = [] if profile else None
            phase("pass buffers")
            run.run(np.concatenate([items[b].tokens[done[b]:done[b] + n] for b, n in pieces]),
                    time_layers)
            phase("layers")
            if all_logits:
                logits[0].append(run.logits())
            else:  # the rows of the items that end in this pass
                last = [(b, seg.rows.stop - 1) for (b, n), seg in zip(pieces, segments)
                        if done[b] + n == items[b].tokens.size]
                for (b, _), x in zip(last, run.logits([r for _, r in last]) if last else ()):
                    logits[b] = x
            phase("logits")
            for (b, n), seg in zip(pieces, segments):
                done[b] += n
                waiting[b] = seg.waiting
            fed += pieces
            self.last_pass = run
            observed += run.observed
        steps: dict = {}
        gpu_state.hand_off(device, list(zip(states, [i.state for i in items], ends,
                                                 waiting)), steps)
        phase("state out")
        phases.update({f"state out ({k})": v for k, v in steps.items()})  # its parts
        if gpu.module_load_s > modules:  # a kernel the warm-up's pass had not loaded
            phases["of which module loads"] = gpu.module_load_s - modules
        if self.verbose and n_rows > 2:
            self._say(f"gpu prefill of {len(items)} sequence(s), {n_rows} rows: " + ", ".join(
                f"{k} {v:.3f} s" for k, v in phases.items()))
        for b, n in fed:
            if items[b].on_block is not None:
                items[b].on_block(n)
        for layer, experts, weights, norms in observed:
            self.observer(layer, experts, weights, norms)
        return [np.concatenate(rows) for rows in logits] if all_logits else logits


def _waiting(model, state):
    """The state's MTP hidden states waiting on the device: [0, H] (a fresh state) or [1, H]."""
    from fermijit.jit import gpu

    n = state.hidden.shape[0]
    if n > 1:  # as model/mtp.py after_block
        raise FermijitError(f"mtp: {n} hidden states waiting before a prefill (1 at rest)")
    if n == 0:
        return gpu.empty((0, model.hidden))
    return gpu.to_device("gpu prefill", "mtp hidden", np.ascontiguousarray(state.hidden),
                         np.float32)


class AutoPrefiller:
    """gpu for prompts of at least `min_tokens`, cpu below."""

    name = "auto"

    def __init__(self, gpu: GpuPrefiller, min_tokens: int = AUTO_MIN_TOKENS):
        self.gpu, self.cpu, self.min_tokens = gpu, gpu.cpu, min_tokens
        self.n_prefilled = gpu.n_prefilled

    def prepare(self) -> bool:
        return self.gpu.prepare()

    @property
    def chunk_tokens(self) -> int | None:
        return self.gpu.chunk_tokens if self.gpu.prepare() else self.cpu.chunk_tokens

    def reserve(self, n_sequences: int, n_tokens: int = RESERVE_TOKENS) -> None:
        self.gpu.reserve(n_sequences, n_tokens)

    def driver_ready(self) -> bool:
        return self.gpu.driver_ready()

    def host_memory(self, nbytes: int) -> np.ndarray:
        return self.gpu.host_memory(nbytes)

    def for_tokens(self, n_tokens: int):
        """The prefiller that takes a prompt of `n_tokens`."""
        return self.gpu if n_tokens >= self.min_tokens and self.gpu.prepare() else self.cpu


    def prefill(self, tokens, state, on_block=None, all_logits: bool = False,
                align: int | None = None) -> np.ndarray:
        return self.for_tokens(np.size(tokens)).prefill(tokens, state, on_block, all_logits, align)

    def prefill_batch(self, items: list[PrefillItem], align: int | None = None) -> list:
        """The items of at least `min_tokens` tokens on the GPU (where usable), the others
        together on the CPU; the logits in the items' order."""
        logits = [None] * len(items)
        for prefiller in (self.gpu, self.cpu):
            mine = [k for k, i in enumerate(items) if self.for_tokens(i.tokens.size) is prefiller]
            if mine:
                for k, row in zip(mine, prefiller.prefill_batch([items[k] for k in mine],
                                                                align)):
                    logits[k] = row
        return logits


# Whether `preparing` runs `then` (the server's page-locked hand-off room and GDN pool, ~1 GB at
# full size) on a thread of its own as soon as the driver is up, beside the rest of the GPU's
# start (its registration, uploads, module loads and 2-token pass), instead of after it, where it
# was the last ~0.5 s before "ready" on the H200's host (issue 28 item 4).
# FERMIJIT_PIN_AHEAD=0: after, as before.
PIN_AHEAD_ENV = "FERMIJIT_PIN_AHEAD"
# FERMIJIT_GPU_PASS_AFTER=1 (an experiment for issue 28 item 4, start_bench.py's "passafter"):
# the GPU's 2-token pass waits for the block (the CPU kernels' warm-up) to end. On the H100's
# host the two overlapped and each took longer than alone (kernels 1.77 s against ~0.6 with
# --prefill cpu; the pass 0.92 s against 0.19 s for a 64-token request's layers): whether the GIL
# and the process's memory map they share make the sum longer than one after the other.
PASS_AFTER_ENV = "FERMIJIT_GPU_PASS_AFTER"
# FERMIJIT_GPU_WARM_WHOLE=1: the GPU's 2-token pass of the start over every layer, as before it
# took one of each kind (DeviceModel.sample; start_bench.py's "gpuwhole").
GPU_WARM_WHOLE_ENV = "FERMIJIT_GPU_WARM_WHOLE"


@contextlib.contextmanager
def preparing(prefiller, then=None):
    """`prefiller.prepare()` on a thread while the block runs (the CPU kernels' warm-up: the
    GPU's start, ~2.6 s at full size on the H200, overlaps it instead of following it), and
    `then()` where given and the GPU's driver is up, on a thread of its own from then
    (PIN_AHEAD_ENV; else after the prepare: the server's page-locked room, whose driver calls
    release the GIL); yields a dict that gets "started" (perf_counter), "seconds" (None when the
    GPU could not start), "then" (`then`'s result), "then_started" and "then_s" once the block
    is done."""
    from fermijit.jit import omp

    result: dict = {}
    gpu_prefiller = getattr(prefiller, "gpu", prefiller)
    ahead = (then is not None and os.environ.get(PIN_AHEAD_ENV, "1") != "0"
             and hasattr(gpu_prefiller, "on_driver"))
    threads = []

    def run_then() -> None:
        start = result["then_started"] = time.perf_counter()
        try:
            result["then"] = then()
        except Exception as e:  # noqa: BLE001 - then the caller does without it
            print(f"gpu prefill: {one_line(e)}", file=sys.stderr, flush=True)
        result["then_s"] = time.perf_counter() - start

    def then_ahead() -> None:
        from fermijit.jit import gpu

        try:
            run_then()
        finally:
            gpu.release_thread()

    def on_driver() -> None:
        gpu_prefiller.on_driver = None
        thread = threading.Thread(target=then_ahead, name="fermijit-gpu-pin-ahead", daemon=True)
        threads.append(thread)
        thread.start()

    def run() -> None:
        if ahead:
            gpu_prefiller.on_driver = on_driver
        start = result["started"] = time.perf_counter()
        result["seconds"] = time.perf_counter() - start if prefiller.prepare() else None
        if then is not None and result["seconds"] is not None and not ahead:
            run_then()
        for thread in threads:
            thread.join()

    if isinstance(prefiller, CpuPrefiller) or not omp.available():
        # Without the omp layer two threads' parallel kernels at once abort the process
        # (Numba's workqueue layer is not thread-safe): the GPU then starts after the block.
        yield result
        if not isinstance(prefiller, CpuPrefiller):
            run()
        return

    def prepare() -> None:
        from fermijit.jit import gpu

        try:
            run()
        finally:
            gpu.release_thread()

    gate = None
    if os.environ.get(PASS_AFTER_ENV) == "1" and hasattr(gpu_prefiller, "pass_gate"):
        gate = gpu_prefiller.pass_gate = threading.Event()
    thread = threading.Thread(target=prepare, name="fermijit-gpu-prepare", daemon=True)
    thread.start()
    try:
        yield result
    finally:
        if gate is not None:
            gate.set()
        thread.join()


def make(model, mode: str = "auto", gpu_mem=None, pin_budget=None, verbose: bool = False,
         err=None):
    """The prefiller `mode` asks for (--prefill, --gpu-mem, --pin-budget, --verbose)."""
    if mode not in MODES:
        raise FermijitError(f"--prefill must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "cpu":
        return CpuPrefiller(model)
    gpu = GpuPrefiller(model, parse_bytes(gpu_mem), parse_bytes(pin_budget), verbose, err,
                       is_quiet_without_gpu=mode == "auto")
    return gpu if mode == "gpu" else AutoPrefiller(gpu)


def one_line(e: Exception) -> str:
    """One line for any failure of the GPU path."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if isinstance(e, FermijitError):
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
