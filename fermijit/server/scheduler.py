"""The thread that owns the model (issue 14 items 2-3): jobs wait in a bounded queue, join the
batch between steps, and every step decodes all active sequences in one forward
(model/batch.py decode_batch).

A job joins by being tokenised (the chat template rendered here, on this thread: the template's
sandbox caps the process's address space while it renders) and prefilled through the engine's
snapshot prefix cache, so a second chat turn prefills only what the cache lacks and
`cached_tokens` says how much it had. A sequence ends at an end-of-sequence id or a stop string
("stop"), at max_tokens ("length"), or when its client is gone; its state is then snapshotted
(prompt and answer), as `generate` does, for the next turn. Stop strings are held back from the
stream until they can no longer match (`StopMatcher`).

With an engine loaded for speculative decoding (fermijit/speculative.py: the default where the
model has an MTP head and it pays, `serve --speculative none` turns it off), a step with one
sequence active drafts and verifies (`_speculative_step`); with several, the batched step reads
the weights once for all of them, and each sequence's head catches up at its next draft.
"""

from __future__ import annotations

import dataclasses
import queue
import sys
import threading
import traceback

import numpy as np

from fermijit import FermijitError
from fermijit.server import protocol
from fermijit.server.protocol import ApiError, Failed, Finished, Job, Started, Text

# max_tokens when a request gives none: the rest of the context, at most this (a KV cache is
# allocated for prompt + max_tokens: the real model's 262144 positions would be 10 GiB each).
DEFAULT_MAX_TOKENS = 4096
IDLE_WAIT_S = 0.1  # how often an idle scheduler looks at `is_running`
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


@dataclasses.dataclass
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
    speculator: object = None    # speculative.Speculator, where the engine drafts
    n_fed: int | None = None     # in a speculative step: its tokens fed before the one accepted


class Scheduler:
    """Runs `engine` (fermijit/engine.py Engine) on its own thread; `submit` from any thread."""

    def __init__(self, engine, max_batch: int = 8, queue_size: int = 64, drafts=None):
        """`drafts` (speculative.Drafts, default one draft a step) where the engine was loaded
        for speculative decoding."""
        if max_batch < 1 or queue_size < 1:
            raise FermijitError(f"max_batch and queue_size must be >= 1, got {max_batch}, "
                                f"{queue_size}")
        self.engine, self.max_batch = engine, max_batch
        if engine.speculative and drafts is None:
            from fermijit.speculative import Drafts
            drafts = Drafts()
        self.drafts = drafts if engine.speculative else None
        self.waiting: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self.active: list[Sequence] = []
        self.n_steps = 0             # batched decode steps run
        self.n_cancelled = 0         # sequences stopped because their client went away
        if engine.tokenizer.chat_template is None:
            engine.tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
        self._is_running = False
        self._thread: threading.Thread | None = None
        self._workspaces: dict = {}  # B -> model.batch.BatchWorkspace

    # --- any thread -----------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        try:
            self.waiting.put_nowait(job)
        except queue.Full:
            raise QueueFull from None

    def start(self) -> None:
        self._is_running = True
        self._thread = threading.Thread(target=self._run, name="fermijit-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._is_running = False
        if self._thread is not None:
            self._thread.join()

    # --- the scheduler's thread -----------------------------------------------------------------

    def _run(self) -> None:
        while self._is_running:
            self._admit()
            if not self.active:
                continue
            try:
                self._step()
            except Exception as e:  # a bug: fail the batch, keep serving
                traceback.print_exc(file=sys.stderr)
                for s in self.active:
                    self._fail(s.job, ApiError(500, f"internal error: {e}", kind="server_error"))
                self.active = []

    def _admit(self) -> None:
        while len(self.active) < self.max_batch:
            try:
                job = self.waiting.get(timeout=IDLE_WAIT_S) if not self.active else \
                    self.waiting.get_nowait()
            except queue.Empty:
                return
            if job.cancelled.is_set():
                self.n_cancelled += 1
                continue
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
            if not seq.is_done:
                self.active.append(seq)

    def _tokens(self, job: Job) -> np.ndarray:
        tokenizer = self.engine.tokenizer
        if job.is_chat:
            text = tokenizer.render_chat(job.prompt)
            return tokenizer.encode(text, add_special_tokens=False)
        if isinstance(job.prompt, str):
            return tokenizer.encode(job.prompt)
        ids = np.asarray(job.prompt, np.int64)
        if ids.min() < 0 or ids.max() >= self.engine.model.vocab_size:
            raise ApiError(400, f"token ids must be in [0, {self.engine.model.vocab_size})",
                           "prompt")
        return ids.astype(np.int32)

    def _image_prompt(self, job: Job):
        """The chat with its images (model/multimodal.py Prompt); a bad image is a 400."""
        from fermijit.model import image

        try:
            images = [image.from_data_uri(uri, f"image {k}") for k, uri in enumerate(job.images)]
            return self.engine.image_prompt(job.prompt, images)
        except FermijitError as e:
            raise ApiError(400, str(e), "messages") from None

    def _start(self, job: Job) -> Sequence:
        from fermijit import engine as engine_module

        engine, model = self.engine, self.engine.model
        with_images = self._image_prompt(job) if job.images else None
        prompt = self._tokens(job) if with_images is None else with_images.ids
        n_prompt, max_context = int(prompt.size), model.max_context
        if n_prompt == 0:
            raise ApiError(400, "the prompt is empty (no tokens)", "prompt")
        if n_prompt >= max_context or (job.max_tokens is not None
                                       and n_prompt + job.max_tokens > max_context):
            raise protocol.context_overflow(n_prompt, job.max_tokens, max_context, job.is_chat)
        max_tokens = job.max_tokens or min(max_context - n_prompt, DEFAULT_MAX_TOKENS)
        settings = engine_module.Settings(max_tokens=max_tokens, temperature=job.temperature,
                                          top_k=job.top_k, top_p=job.top_p, seed=job.seed)
        sampler = engine.sampler(settings)
        if with_images is None:
            state, logits, n_cached = engine_module.prefill(model, prompt, n_prompt + max_tokens,
                                                            engine.cache, None, engine.prefiller,
                                                            mtp=self.drafts is not None)
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
        self._accept(seq, sampler.sample(logits), logits)
        return seq

    def _step(self) -> None:
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
        if reason is not None:
            s.job.emit(Finished(reason, n_prompt, s.n_cached, len(s.generated)))

    @staticmethod
    def _fail(job: Job, error: ApiError) -> None:
        job.emit(Failed(error))
