"""The thread that owns the model: jobs wait in a bounded queue, join the
batch between steps, and every step decodes all active sequences in one forward
(model/batch.py decode_batch).

A job arrives tokenised (server/prompts.py, on the request's handler thread) and joins by being
restored from the engine's snapshot prefix cache, so a second chat turn prefills only what the
cache lacks and `cached_tokens` says how much it had. The rest of its prompt is prefilled in
chunks between decode steps (`_prefill_chunk`): each chunk is one `prefill_batch` call of the
engine's prefiller over the next pieces of every prompt waiting (prompts that arrive together
are prefilled together, weights read once for all), at most `prefiller.chunk_tokens` tokens
but for a newly arrived prompt's first piece, which runs at once; while streams decode, later
chunks take at most PREFILL_SHARE of the time, so a long prompt does not stall them. The pieces
are cut by model/forward.py `pass_size` and snapshotted as `generate`'s prefill is
(engine.PromptPrefill), so a chunked prompt has the bits and the snapshots of one prefilled
whole. The GPU prefill (a prefiller that `runs_beside_decode`) takes whole prompts, those waiting
together in one call, on a thread of its own (`GpuJob`): the streams keep decoding on the CPU
meanwhile, and the prompts start decoding once it ends. A prefill that fails (a GPU fault)
restarts that prompt from the cache on the CPU, alone; if that fails too, that request alone
fails.

A sequence ends at an end-of-sequence id or a stop string ("stop"), at max_tokens ("length"), or
when its client is gone; its state is then snapshotted (prompt and answer), as `generate` does,
for the next turn. Stop strings are held back from the stream until they can no longer match
(`StopMatcher`).

With an engine loaded for speculative decoding (fermijit/speculative.py: the default where the
model has an MTP head and it is projected to pay: speculative.pays; `serve --speculative mtp|none`
decides), a step with one
sequence active drafts and verifies (`_speculative_step`); with several, the batched step reads
the weights once for all of them, and each sequence's head catches up at its next draft.
"""

from __future__ import annotations

import dataclasses
import queue
import sys
import threading
import time
import traceback

import numpy as np

from fermijit import FermijitError
from fermijit.jit import omp
from fermijit.server.protocol import (ApiError, Failed, Finished, Job, Started, Text,
                                      server_stopping)
from fermijit.server.state_pool import GdnPool

# max_tokens when a request gives none: the rest of the context, at most this (a KV cache is
# allocated for prompt + max_tokens: the real model's 262144 positions would be 10 GiB each).
DEFAULT_MAX_TOKENS = 4096
IDLE_WAIT_S = 0.1  # how often an idle scheduler looks at `is_running`
# While streams decode, prefill chunks take at most this share of the scheduler's time, so the
# streams keep at least the rest of their rate (issue 28 item 5 asks >= 50 %: the share leaves
# room for the chunks' switching cost; measured in /work/notes/serve.md).
PREFILL_SHARE = 0.4
GPU_JOB_POLL_S = 0.005  # how often an otherwise idle scheduler looks for new requests meanwhile
# An idle scheduler that gets a request admits those that follow it within this gap of each
# other before it prefills, so prompts that arrive together are prefilled together (one GPU
# pass over all their rows: issue 28 item 5's 8 concurrent prompts, whose requests reach it
# milliseconds apart; the first one's GPU pass would otherwise start alone).
GATHER_S = 0.005
# ChatML (the Qwen family's format), for a model that ships no chat template (the embedded one).
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class QueueFull(Exception):
    pass


class StopMatcher:
    """Text in, text safe to stream out: a stop string ends the text before it; the tail that
    could still grow into a stop string is held back until it cannot."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.pending = stops, ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text to emit, whether a stop string was met)."""
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buf[:min(hits)], True
        hold = max((n for s in self.stops for n in range(min(len(s) - 1, len(buf)), 0, -1)
                    if buf.endswith(s[:n])), default=0)
        self.pending = buf[len(buf) - hold:]
        return buf[:len(buf) - hold], False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


# eq=False: a sequence is itself (`remove`, `in` on the scheduler's lists); by value, two of the
# same seeded request compared their jobs down to their token arrays: a ValueError, a 500 for
# every prompt of the chunk (tests/fermijit/server/test_soak.py).
@dataclasses.dataclass(eq=False)
class Sequence:
    job: Job
    prompt: np.ndarray           # int32 [n_prompt]
    n_cached: int
    max_tokens: int
    state: object                # model.state.State
    sampler: object              # ops.sampling.Sampler
    decoder: object              # model.tokenizer.StreamDecoder
    stops: StopMatcher
    token: int = -1              # the last sampled token: the next to feed
    generated: list[int] = dataclasses.field(default_factory=list)
    is_done: bool = False
    has_images: bool = False     # not snapshotted: image tokens' ids do not say which image
    # While its prompt is prefilled (engine.PromptPrefill; None once decoding), by whom (the
    # engine's prefiller; the CPU's, alone, after a failure), and whether a chunk has had it.
    prefill: object = None
    prefiller: object = None
    is_alone: bool = False
    is_new: bool = True
    is_in_flight: bool = False   # its prompt on the GPU's own thread (GpuJob)

    speculator: object = None    # speculative.Speculator, where the engine drafts
    n_fed: int | None = None     # in a speculative step: its tokens fed before the one accepted


class GpuJob:
    """One prefill_batch call of a prefiller that runs beside decode (the GPU's: its kernels and
    copies need the host only to launch them and read the routing), on a thread of its own, so
    the running streams keep decoding on the CPU while a long prompt prefills (a
    GPU call takes whole prompts, seconds at 16k tokens)."""

    def __init__(self, prefiller, group: list, align: int | None, n_threads: int):
        self.seqs = [s for s, _ in group]
        self.items = [item for _, item in group]
        self.logits: list | None = None
        self.error: Exception | None = None
        self.done = threading.Event()
        self.prefiller = prefiller
        self.started = self.ended = time.perf_counter()  # the thread's start, its call's end
        for s in self.seqs:
            s.is_in_flight = True
        threading.Thread(target=self._run, args=(prefiller, align, n_threads), daemon=True,
                         name="fermijit-gpu-prefill").start()

    def _run(self, prefiller, align: int | None, n_threads: int) -> None:
        import numba

        from fermijit.jit import gpu

        numba.set_num_threads(n_threads)  # a fallback to the CPU runs kernels here
        try:
            self.logits = prefiller.prefill_batch(self.items, align)
        except Exception as e:  # noqa: BLE001 - handled on the scheduler's thread
            self.error = e
        finally:
            self.ended = time.perf_counter()
            gpu.release_thread()
            self.done.set()


def ready_to_serve(prefiller, model, max_batch: int, on_pool=None) -> GdnPool | None:
    """Where `prefiller` prefills on the GPU: its page-locked hand-off room for a batch of
    `max_batch` prompts, and a pool of `max_batch` sequences' GDN states in page-locked memory
    (the hand-off writes them by DMA in place); None elsewhere (the CPU's prefill pools none).
    Made on the scheduler's thread before its first request, a fresh server's first request
    waited for them (~1 GB page-locked at full size); serve makes them as it starts, on the
    GPU's thread (fermijit/server/run.py). `on_pool(pool)` before the pool is filled."""
    reserve = getattr(prefiller, "reserve", None)
    if reserve is None:
        return None
    reserve(max_batch)  # a batch of prompts together, before any arrives
    # Where the driver is up (the rest of the GPU's start may still run beside: hybrid.preparing)
    if not getattr(prefiller, "driver_ready", prefiller.prepare)():
        return None
    pool = GdnPool(model, max_batch)
    if on_pool is not None:
        on_pool(pool)
    pool.fill(max_batch, getattr(prefiller, "host_memory", None))  # page-locked: DMA in place
    return pool


class Scheduler:
    """Runs `engine` (fermijit/engine.py Engine) on its own thread; `submit` from any thread."""

    def __init__(self, engine, max_batch: int = 8, queue_size: int = 64,
                 kv_mem: int | None = None, drafts=None, gdn_pool=None):
        """`kv_mem`: bytes the running sequences' states may hold (--kv-mem); `drafts`
        (speculative.Drafts, default one draft a step) where the engine was loaded for
        speculative decoding; `gdn_pool`: new sequences' GDN states made ready already, with
        the GPU prefiller's hand-off room (`ready_to_serve`; serve makes them as it starts),
        else the scheduler's thread makes them before it takes its first request."""
        if max_batch < 1 or queue_size < 1:
            raise FermijitError(f"max_batch and queue_size must be >= 1, got {max_batch}, "
                                f"{queue_size}")
        from fermijit.server import kv_budget

        self.engine, self.max_batch = engine, max_batch
        # Bytes the running sequences' states may hold (--kv-mem; fermijit/server/kv_budget.py).
        self.kv_mem = kv_budget.budget_of(kv_mem)
        from fermijit.speculative import engine_drafts

        self.drafts = engine_drafts(engine, drafts)
        self.waiting: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self.active: list[Sequence] = []       # decoding
        self.prefilling: list[Sequence] = []   # admitted, their prompts in progress
        self.n_steps = 0             # batched decode steps run
        self.n_chunks = 0            # prefill chunks run
        self.n_cancelled = 0         # sequences stopped because their client went away
        self.n_prefill_failures = 0  # prefill_batch calls that raised
        self.prefill_s = self.decode_s = 0.0  # seconds in prefill chunks, in decode steps
        self.last_chunk_s = 0.0
        # Seconds the running streams are owed in decode before the next chunk (PREFILL_SHARE)
        self._decode_owed = 0.0
        self._cpu_prefiller = None   # the fallback, made on first need
        self._gpu_job: GpuJob | None = None
        self._gathered_at = 0.0      # when an idle scheduler took its latest batch's first job
        self._n_threads = 1
        if engine.tokenizer.chat_template is None:
            engine.tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
        self._is_running = False
        self._is_stopped = False
        self._thread: threading.Thread | None = None
        self._workspaces: dict = {}  # B -> model.batch.BatchWorkspace
        # New sequences' GDN states, resident (server/state_pool.py): a batch's worth where the
        # GPU prefills (`_serve`), none on the CPU (its prefill's own page faults are noise); and
        # the sequences ended but not yet given back (`_finish`: those ended in `_prefilled`).
        self.gdn_pool = GdnPool(engine.model, 0) if gdn_pool is None else gdn_pool
        self._is_pool_ready = gdn_pool is not None
        self._ended: list[Sequence] = []
        self._is_deferring = False   # inside `_prefilled`: ended states given back after it
        self.weights_changed: str | None = None  # why every request fails (`_check_weights`)

    # --- any thread -----------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        if self._is_stopped:  # the server is shutting down: nothing would serve it
            raise server_stopping()
        try:
            self.waiting.put_nowait(job)
        except queue.Full:
            # Requests whose clients left stay queued until a batch place frees (then dropped):
            # theirs go to this one, not a 503 while the running streams last.
            with self.waiting.mutex:
                live = [j for j in self.waiting.queue if not j.cancelled.is_set()]
                self.waiting.queue.clear()
                self.waiting.queue.extend(live)
                self.waiting.not_full.notify_all()
            try:
                self.waiting.put_nowait(job)
            except queue.Full:
                raise QueueFull from None

    def n_waiting(self) -> int:
        """Requests waiting to join whose clients are still there (/health): a cancelled one
        stays queued until `submit` clears it from a full queue or `_admit` takes it."""
        with self.waiting.mutex:
            return sum(not job.cancelled.is_set() for job in self.waiting.queue)

    def start(self) -> None:
        from fermijit.jit import cpu

        self._is_running = True
        # Numba's thread count is per thread: a new one has all the CPUs', whatever --threads
        # said (4 decoding streams on a busy 2-core machine: 270 ms a step at --threads 1,
        # against 22 ms on the thread that set it); the scheduler's thread takes the caller's.
        self._thread = threading.Thread(target=self._run, args=(cpu.configure_threads(None),),
                                        name="fermijit-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """The thread ended after its current step; then every request queued or running fails
        with a 503, so that its client gets an answer (a stream OpenAI's error event and
        [DONE]) as the server stops, not a connection cut once uvicorn's grace is over."""
        self._is_stopped, self._is_running = True, False
        if self._thread is not None:
            self._thread.join()
        for s in self.active + self.prefilling:
            self._fail(s.job, server_stopping())
        self.active, self.prefilling = [], []
        while True:
            try:
                self._fail(self.waiting.get_nowait(), server_stopping())
            except queue.Empty:
                return

    # --- the scheduler's thread -----------------------------------------------------------------

    def _run(self, n_threads: int) -> None:
        import numba

        numba.set_num_threads(n_threads)
        self._n_threads = n_threads
        try:
            self._serve()
        finally:
            from fermijit.jit import gpu

            gpu.release_thread()  # the GPU prefill ran on this thread

    def _serve(self) -> None:
        if not self._is_pool_ready:  # the pool in place before it fills, as before
            self._guarded(lambda: ready_to_serve(
                self.engine.prefiller, self.engine.model, self.max_batch,
                on_pool=lambda pool: setattr(self, "gdn_pool", pool)), "prefilling")
        while self._is_running:
            self._check_weights()
            self._admit()
            self._collect_gpu_job()
            waiting = [s for s in self.prefilling if not s.is_in_flight]
            if waiting and (not self.active or self._decode_owed <= 0
                            or any(s.is_new for s in waiting)):
                start, had_streams = time.perf_counter(), bool(self.active)
                self._guarded(self._prefill_chunk, "prefilling")
                self.last_chunk_s = time.perf_counter() - start
                self.prefill_s += self.last_chunk_s
                if had_streams:  # they waited this long: owed as PREFILL_SHARE says
                    self._decode_owed += self.last_chunk_s * (1 - PREFILL_SHARE) / PREFILL_SHARE
            if not self.active:
                self._decode_owed = 0.0
                if self._gpu_job is not None:  # nothing to decode: wait for it, not spin
                    self._gpu_job.done.wait(GPU_JOB_POLL_S)
                continue
            start = time.perf_counter()
            self._guarded(self._step, "active")
            elapsed = time.perf_counter() - start
            self.decode_s += elapsed
            self._decode_owed = max(0.0, self._decode_owed - elapsed)

    def _check_weights(self) -> None:
        """The weights file rewritten in place under the server (model/files.py
        check_mappings): said once on stderr, and every request fails from then on, the
        running ones too, with that line (their answers came from a mix of two files, 200
        without a word); a restart maps the new file."""
        if self.weights_changed is None:
            from fermijit.model import files

            try:
                files.check_mappings()
                return
            except FermijitError as e:
                self.weights_changed = f"{e}: restart the server"
                print(f"Error: {self.weights_changed}", file=sys.stderr, flush=True)
        for group in ("active", "prefilling"):
            for s in getattr(self, group):
                self._fail(s.job, self._weights_error())
            setattr(self, group, [])

    def _weights_error(self) -> ApiError:
        return ApiError(503, self.weights_changed, kind="server_error")

    def _guarded(self, work, group: str) -> None:
        """work(); on a bug, fail the sequences of `group` (a list attribute) and keep serving."""
        try:
            work()
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            for s in getattr(self, group):
                self._fail(s.job, ApiError(500, f"internal error: {e}", kind="server_error"))
            setattr(self, group, [])

    def _admit(self) -> None:
        was_idle = not (self.active or self.prefilling)
        while len(self.active) + len(self.prefilling) < self.max_batch:
            try:
                if not (self.active or self.prefilling):
                    job = self.waiting.get(timeout=IDLE_WAIT_S)
                elif was_idle:
                    job = self.waiting.get(timeout=GATHER_S)
                else:
                    job = self.waiting.get_nowait()
            except queue.Empty:
                return
            if job.cancelled.is_set():
                self.n_cancelled += 1
                continue
            self._check_weights()  # again: the wait for this job may have been long
            if self.weights_changed is not None:
                self._fail(job, self._weights_error())
                continue
            if not (self.active or self.prefilling):
                self._gathered_at = time.perf_counter()
            try:
                seq = self._start(job)
            except ApiError as e:
                self._fail(job, e)
                continue
            except FermijitError as e:
                self._fail(job, ApiError(400, str(e)))
                continue
            except Exception as e:
                traceback.print_exc(file=sys.stderr)
                self._fail(job, ApiError(500, f"internal error: {e}", kind="server_error"))
                continue
            if seq.prefill is not None:
                self.prefilling.append(seq)
            elif not seq.is_done:
                self.active.append(seq)

    def _start(self, job: Job) -> Sequence:
        from fermijit import engine as engine_module
        from fermijit.server import kv_budget

        engine, model = self.engine, self.engine.model
        # Tokenised (and its images run through the tower) by the request's handler, and
        # checked against the context there (server/prompts.py).
        with_images, prompt = job.image_prompt, job.ids
        n_prompt, max_context = int(prompt.size), model.max_context
        max_tokens = job.max_tokens or min(max_context - n_prompt, DEFAULT_MAX_TOKENS)
        # The prompts still prefilling hold their states too: counting the decoding ones only
        # let a burst that arrived together (prefilled in chunks) past --kv-mem.
        kv_budget.admit(model, n_prompt + max_tokens,
                        (s.prompt.size + s.max_tokens for s in self.active + self.prefilling),
                        self.kv_mem, mtp=self.drafts is not None)
        settings = engine_module.Settings(max_tokens=max_tokens, temperature=job.temperature,
                                          top_k=job.top_k, top_p=job.top_p, seed=job.seed)
        sampler = engine.sampler(settings)
        if with_images is None:  # restored from the cache; the rest by _prefill_chunk
            # a new state's GDN layers the pool's (not restored from the cache; none made to
            # be replaced: 8 full-size states' np.zeros cost 23-70 ms of the batch's admission)
            p = engine_module.PromptPrefill(model, prompt, n_prompt + max_tokens, engine.cache,
                                              mtp=self.drafts is not None,
                                              gdn=self.gdn_pool.take_one)
            state, logits, n_cached = p.state, p.logits, p.n_cached
        else:  # on the CPU, as generate --image, and without the cache
            from fermijit.model import multimodal

            state, n_cached = model.new_state(n_prompt + max_tokens), 0
            logits = multimodal.prefill(model, with_images, state)
        seq = Sequence(job, prompt, n_cached, max_tokens, state, sampler,
                       engine.tokenizer.stream(), StopMatcher(job.stop),
                       has_images=with_images is not None)
        if self.drafts is not None and with_images is None:
            from fermijit.speculative import Speculator

            seq.speculator = Speculator(model, sampler, self.drafts)
        job.emit(Started(n_prompt, n_cached))
        if logits is None:
            seq.prefill, seq.prefiller = p, self._prefiller()
        else:
            self._accept(seq, sampler.sample(logits), logits)
        return seq

    def _prefiller(self):
        return self.engine.prefiller or self._cpu()

    def _cpu(self):
        from fermijit.prefill.hybrid import CpuPrefiller

        if self._cpu_prefiller is None:
            self._cpu_prefiller = CpuPrefiller(self.engine.model)
        return self._cpu_prefiller

    def _prefill_chunk(self) -> None:
        """One chunk: the next piece of each prompt waiting (only the new ones' while the
        streams are owed decode time), one prefill_batch call per prefiller; a prompt whose
        last piece this was samples its first token and starts decoding."""
        from fermijit.model.forward import pass_size
        from fermijit.prefill.hybrid import PrefillItem

        live = self._drop_cancelled()
        is_owed = bool(self.active) and self._decode_owed > 0
        # The new first (each its first piece, so that arrivals together go together), then
        # the prompts with the fewest tokens left (short prompts' first tokens come soon).
        order = sorted(live, key=lambda s: (not s.is_new, s.prefill.rest.size))
        groups: dict = {}
        beside: list = []  # for a GpuJob: whole prompts, while the streams decode
        rows_left = None  # of the chunk, for the prompts past their first piece
        for s in order:
            prefiller, rest = self._prefiller_of(s), s.prefill.rest
            if s.is_in_flight:
                continue
            if prefiller.runs_beside_decode and omp.available():
                if self._gpu_job is None and not s.is_alone:
                    beside.append((s, PrefillItem(rest, s.state, s.prefill.on_block)))
                continue
            if is_owed and not s.is_new:
                continue
            budget = prefiller.chunk_tokens
            if budget is None:  # whole prompts (the GPU's: hybrid.GpuPrefiller.chunk_tokens)
                n = rest.size
            else:
                limit = budget if s.is_new or rows_left is None else rows_left
                n = pass_size(s.state.position, rest.size, s.prefill.align, limit)
                if not s.is_new:
                    rows_left = limit - n
            if n:
                key = id(s) if s.is_alone else id(prefiller)
                groups.setdefault(key, []).append((s, PrefillItem(rest[:n], s.state,
                                                                  s.prefill.on_block)))
        if beside:
            self._gpu_job = GpuJob(self._prefiller_of(beside[0][0]), beside,
                                   beside[0][0].prefill.align, self._n_threads)
        for group in groups.values():
            seqs = [s for s, _ in group]
            prefiller = self._prefiller_of(seqs[0])
            try:
                logits = prefiller.prefill_batch([item for _, item in group],
                                                 seqs[0].prefill.align)
            except Exception as e:  # noqa: BLE001 - a GPU fault is any exception
                self._prefill_failed(seqs, e)
                continue
            for s in seqs:
                s.is_new = False
            self._prefilled([(s, row) for s, row in zip(seqs, logits)
                             if s.prefill.rest.size == 0])
        self.n_chunks += bool(groups)

    def _drop_cancelled(self, give_back: bool = True) -> list[Sequence]:
        """The prompts still prefilling less those whose clients went away, but for those on the
        GPU's thread (GpuJob): it writes their states until its call ends, so they count
        against --kv-mem and --max-batch till `_collect_gpu_job`. The states of those dropped
        go back to the pool (each such request took one for good), unless `give_back` is
        False: a failed call may have half written them (as `_prefill_failed`)."""
        live = []
        for s in self.prefilling:
            if s.job.cancelled.is_set() and not s.is_in_flight:
                self.n_cancelled += 1
                if give_back:
                    self.gdn_pool.give(s.state)
            else:
                live.append(s)
        self.prefilling = live
        return live

    def _prefiller_of(self, s: Sequence):
        """Who prefills `s`'s rest now: auto's choice for its length (hybrid.AutoPrefiller)."""
        choose = getattr(s.prefiller, "for_tokens", None)
        return s.prefiller if choose is None else choose(s.prefill.rest.size)

    def _collect_gpu_job(self) -> None:
        """A GpuJob that has ended: its prompts start decoding (or, if it failed, retry on the
        CPU, as a failed chunk does)."""
        job = self._gpu_job
        if job is None or not job.done.is_set():
            return
        self._gpu_job = None
        for s in job.seqs:
            s.is_in_flight = False
        self._drop_cancelled(give_back=job.error is None)
        live = [s for s in job.seqs if s in self.prefilling]  # not cancelled meanwhile
        if job.error is not None:
            return self._prefill_failed(live, job.error)
        for s in live:
            s.is_new = False
        collected = time.perf_counter()
        sent = self._prefilled([(s, row) for s, row in zip(job.seqs, job.logits)
                                if s in live and s.prefill.rest.size == 0])
        self.n_chunks += 1
        if getattr(job.prefiller, "verbose", False):
            # Where a batch's time to first token goes outside the GPU call's phases (its
            # --verbose line): issue 28 item 5's 8 concurrent prompts.
            done = time.perf_counter()
            print(f"serve: {len(job.seqs)} prompt(s) on the GPU: first taken to the call "
                  f"{max(0.0, job.started - self._gathered_at):.3f} s, the call "
                  f"{job.ended - job.started:.3f} s, its end to collected "
                  f"{collected - job.ended:.3f} s, to the first tokens sent "
                  f"{sent - job.ended:.3f} s, then snapshots {done - sent:.3f} s",
                  file=sys.stderr, flush=True)

    def _prefilled(self, done: list) -> float:
        """Prompts prefilled whole, (sequence, the logits after its prompt) each: every first
        token, then every snapshot, so that of prompts prefilled together none waits for the
        others' snapshots (a state copy each, ~65 MB at full size). Returns when the first
        tokens were sent (time.perf_counter)."""
        prefills, self._is_deferring = [], True
        try:
            for s, logits in done:
                prefills.append(s.prefill)
                s.prefill = None
                self.prefilling.remove(s)
                self._accept(s, s.sampler.sample(logits), logits)  # first tokens, snapshots after
            sent = time.perf_counter()
            for (s, logits), prefill in zip(done, prefills):
                prefill.finish(logits)
                if not s.is_done:
                    self.active.append(s)
        finally:
            self._is_deferring = False
            for s in self._ended:  # those that ended at their first token, now snapshotted
                self.gdn_pool.give(s.state)
            self._ended = []
        return sent

    def _prefill_failed(self, seqs: list[Sequence], e: Exception) -> None:
        """A prefill_batch call raised: each of its prompts restarts from the cache on the CPU,
        alone (its state may be half written); one that failed so already fails its request."""
        from fermijit import engine as engine_module
        from fermijit.prefill.hybrid import one_line

        self.n_prefill_failures += 1
        if not isinstance(e, FermijitError):
            traceback.print_exc(file=sys.stderr)
        if len(seqs) == 1 and seqs[0].is_alone and seqs[0].prefiller is self._cpu():
            print(f"prefill failed on the CPU ({one_line(e)}): that request fails",
                  file=sys.stderr, flush=True)
            self.prefilling.remove(seqs[0])
            return self._fail(seqs[0].job, ApiError(500, f"internal error: the prefill failed: "
                                                         f"{one_line(e)}", kind="server_error"))
        print(f"prefill of {len(seqs)} request(s) failed ({one_line(e)}): each retried alone "
              f"on the CPU", file=sys.stderr, flush=True)
        for s in seqs:
            p = s.prefill
            s.prefill = engine_module.PromptPrefill(self.engine.model, p.prompt,
                                                    p.state.context, self.engine.cache,
                                                    mtp=self.drafts is not None)
            s.state, s.prefiller, s.is_alone = s.prefill.state, self._cpu(), True
            if s.prefill.logits is not None:  # all of it snapshotted before the failure
                self._prefilled([(s, s.prefill.logits)])

    def _step(self) -> None:
        n_before = len(self.active)
        try:
            self._decode_active()
        finally:
            if len(self.active) < n_before:  # a sequence ended: no batch plan keeps its state's
                for ws in self._workspaces.values():  # arrays (its memory goes back)
                    ws.plans.clear()

    def _decode_active(self) -> None:
        from fermijit.model.batch import BatchWorkspace, can_batch, decode_batch

        model = self.engine.model
        live = []
        for s in self.active:
            if s.job.cancelled.is_set():
                self.n_cancelled += 1
                self._finish(s, None, None)
            else:
                live.append(s)
        self.active = live
        if not live:
            return
        if len(live) == 1 and live[0].speculator is not None:
            self._speculative_step(live[0])
            self.active = [s for s in live if not s.is_done]
            return
        if len(live) > 1 and can_batch(model):
            ws = self._workspaces.get(len(live))
            if ws is None:
                ws = self._workspaces[len(live)] = BatchWorkspace(model, len(live))
            logits = decode_batch(model, [s.token for s in live], [s.state for s in live], ws)
        else:  # one sequence, or a model decode_batch does not take: decode itself
            logits = np.stack([model.decode(s.token, s.state) for s in live])
        self.n_steps += 1
        for s, row in zip(live, logits):
            if s.speculator is not None:
                s.speculator.fed(s.token)
            self._accept(s, s.sampler.sample(row), row)
        self.active = [s for s in live if not s.is_done]

    def _speculative_step(self, s: Sequence) -> None:
        """One draft-and-verify step of `s`; its tokens are accepted one at a time as a plain
        step's, and where the sequence ends inside the step `_finish` takes the state back."""
        tokens, _ = s.speculator.step(s.state, s.token)
        self.n_steps += 1
        for i, token in enumerate(tokens):
            s.n_fed = i + 1
            self._accept(s, token, None)
            if s.is_done:
                break
        s.n_fed = None

    def _accept(self, s: Sequence, token: int, logits: np.ndarray) -> None:
        """`token`, sampled from `logits` (after all `s.state` has seen): stream it or end."""
        if token in self.engine.tokenizer.eos_ids and not s.job.ignore_eos:
            return self._finish(s, "stop", logits)
        s.generated.append(token)
        s.token = token
        text, is_stop = s.stops.push(s.decoder.push(token))
        if is_stop:
            self._emit_text(s, text)
            return self._finish(s, "stop", logits)
        if len(s.generated) == s.max_tokens:
            self._emit_text(s, text + s.stops.push(s.decoder.flush())[0] + s.stops.flush())
            return self._finish(s, "length", logits)
        self._emit_text(s, text)

    def _emit_text(self, s: Sequence, text: str) -> None:
        if text:
            s.job.emit(Text(text))

    def _finish(self, s: Sequence, reason: str | None, logits) -> None:
        """End `s` (reason None: its client is gone) and snapshot what it fed the model."""
        s.is_done = True
        if s.speculator is not None and s.n_fed is not None:  # inside a speculative step
            logits = s.speculator.truncate(s.state, s.n_fed) if reason is not None else None
        if s.speculator is not None:
            s.speculator.settle(s.state)              # a snapshot holds settled states only
        cache, n_prompt = self.engine.cache, int(s.prompt.size)
        if (cache is not None and not s.has_images and s.state.position > n_prompt
                and logits is not None):
            fed = np.concatenate([s.prompt, np.asarray(s.generated[:s.state.position - n_prompt],
                                                       np.int32)])
            cache.add(fed, s.state, logits)
        # Over for good (snapshotted): its GDN states to the pool now, so that they are zeroed
        # while the other sequences ending in this step snapshot theirs (a batch that arrives as
        # this one ends then finds them zeroed); in `_prefilled`, once its prompt's snapshot is
        # taken.
        if self._is_deferring:
            self._ended.append(s)
        else:
            self.gdn_pool.give(s.state)
        if reason is not None:
            s.job.emit(Finished(reason, n_prompt, s.n_cached, len(s.generated)))

    @staticmethod
    def _fail(job: Job, error: ApiError) -> None:
        job.emit(Failed(error))
