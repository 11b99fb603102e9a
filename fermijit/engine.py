"""The generate loop (DESIGN.md, Data flow of `generate`): tokenize, prefill the prompt, decode
one token at a time, sample, detokenise and stream; timings and peak memory on the side.

`generate` is the loop on token ids, for any caller; `run` is what `python -m fermijit generate`
calls: load the model and tokenizer, settle the settings, stream text to stdout and the summary
to stderr. Prefill runs on the CPU (the GPU path and the snapshot prefix cache come later).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fermijit import FermijitError

# HF GenerationConfig's defaults, used where the model's generation_config.json says nothing.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_K = 50
DEFAULT_TOP_P = 1.0
WARM_UP_TOKENS = 2  # a prefill of two tokens and a decode step compile or load every kernel
# The embedded model (issue 4), package data: what `generate` and `eval` run without --model.
DEFAULT_MODEL = Path(__file__).parent / "default_model"


class Stop(enum.Enum):
    EOS = "end of sequence"
    MAX_TOKENS = "--max-tokens reached"
    CONTEXT = "context full"


@dataclasses.dataclass(frozen=True)
class Settings:
    """What `generate` was asked for; None takes the model's generation_config.json (sampling)
    or prompt + max_tokens (context)."""

    max_tokens: int = 256
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    context: int | None = None
    is_chat: bool = False


@dataclasses.dataclass
class Stats:
    n_prompt: int = 0
    prefill_s: float = 0.0
    n_generated: int = 0        # tokens streamed (the eos that stops is not one)
    n_decode_steps: int = 0     # forwards of one token
    decode_s: float = 0.0       # the decode loop, sampling and streaming included
    stop: Stop | None = None

    @property
    def prefill_tok_per_s(self) -> float:
        return self.n_prompt / self.prefill_s if self.prefill_s else float("nan")

    @property
    def decode_tok_per_s(self) -> float:
        return self.n_decode_steps / self.decode_s if self.decode_s else float("nan")

    def summary(self) -> str:
        return (f"prompt {self.n_prompt} tokens; prefill {self.prefill_s:.3f} s "
                f"({self.prefill_tok_per_s:.1f} tok/s); generated {self.n_generated} tokens, "
                f"decode {self.decode_tok_per_s:.1f} tok/s ({self.stop.value}); "
                f"peak RSS {peak_rss_bytes() / 2**20:.0f} MiB")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def generate(model, prompt: np.ndarray, sampler, max_tokens: int, context: int,
             eos_ids: frozenset[int], on_token: Callable[[int], None],
             progress_to=None) -> tuple[list[int], Stats]:
    """Prefill `prompt`, then sample and decode until an eos id, `max_tokens` or the end of the
    context; `on_token` gets each generated token as it is made. Returns (tokens, stats). With
    `progress_to` (a text stream), a prompt of several prefill passes shows a progress bar there."""
    from fermijit.model.forward import PREFILL_BLOCK

    stats = Stats(n_prompt=int(prompt.size))
    state = model.new_state(context)
    start = time.perf_counter()
    bar = None
    if progress_to is not None and prompt.size > PREFILL_BLOCK:
        bar = tqdm(total=int(prompt.size), desc="prefill", unit="tok", file=progress_to,
                   leave=False)
    try:
        logits = model.prefill(prompt, state, on_block=None if bar is None else bar.update)
    finally:
        if bar is not None:
            bar.close()
    token = sampler.sample(logits)
    stats.prefill_s = time.perf_counter() - start
    tokens: list[int] = []
    start = time.perf_counter()
    while True:
        if token in eos_ids:
            stats.stop = Stop.EOS
            break
        tokens.append(token)
        on_token(token)
        if len(tokens) == max_tokens:
            stats.stop = Stop.MAX_TOKENS
            break
        if state.position == context:
            stats.stop = Stop.CONTEXT
            break
        token = sampler.sample(model.decode(token, state))
        stats.n_decode_steps += 1
    stats.decode_s = time.perf_counter() - start
    stats.n_generated = len(tokens)
    return tokens, stats


def warm_up(model, prompt: np.ndarray, n_prefill: int = WARM_UP_TOKENS, sampler=None) -> float:
    """Compile (or load from Numba's cache) every kernel of prefill, decode and `sampler` on a
    throwaway state, so that the timings measure the model, not the JIT; returns the seconds it
    took. `sampler` is a twin of the real one, as sampling draws from its generator (its compile
    was 1.4 s of a cold run's "prefill"). Some ops switch to a parallel kernel past a size (e.g.
    ops/rope.py PARALLEL_MIN_ELEMENTS): `n_prefill` as long as the prefills to come compiles
    those too (`eval` does; on the default model a cold prefill of 512 tokens compiled 7 more
    kernels, 3.7 s, after the 2-token one)."""
    start = time.perf_counter()
    model = kernel_sample(model)
    n_prefill = max(1, min(n_prefill, model.max_context - 1))  # and room for the decode step
    tokens = np.resize(prompt, n_prefill)
    state = model.new_state(n_prefill + 1)
    logits = model.prefill(tokens, state)
    if sampler is not None:
        sampler.sample(logits)
    model.decode(int(tokens[-1]), state)
    return time.perf_counter() - start


def kernel_sample(model):
    """`model` cut to its first layers up to one of each kind (GDN, attention): the same kernels
    at a tenth of the work (4 of 40 layers), since layers of a kind differ only in their weights.
    On the REAP-128 shape the whole-model warm-up read ~1.7 GB of weights and ran 40 layers'
    prefill GEMMs for nothing but loading kernels. A shallow copy: weights are shared."""
    kinds = model.is_attention
    n = max(kinds.index(kind) for kind in set(kinds)) + 1
    if n == len(kinds):
        return model
    sample = copy.copy(model)
    sample.layers, sample.is_attention = model.layers[:n], kinds[:n]
    sample._decode_ws = None  # its own (the original's is made on its first decode)
    return sample


def sampling_settings(settings: Settings, generation_config: dict) -> tuple[float, int, float]:
    """(temperature, top_k, top_p): the flags, else the model's generation_config.json (do_sample
    false means greedy), else HF's defaults."""
    def pick(flag, key, default):
        value = generation_config.get(key)
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        return flag if flag is not None else value if is_number else default

    temperature = pick(settings.temperature, "temperature", DEFAULT_TEMPERATURE)
    if settings.temperature is None and generation_config.get("do_sample") is False:
        temperature = 0.0
    top_k = pick(settings.top_k, "top_k", DEFAULT_TOP_K)
    if not top_k >= 0:
        raise FermijitError(f"top_k must be >= 0 (0 = all), got {top_k}")
    return (float(temperature), int(top_k), float(pick(settings.top_p, "top_p", DEFAULT_TOP_P)))


def context_length(settings: Settings, n_prompt: int, max_context: int) -> int:
    """The KV cache length: --ctx, else prompt + max_tokens, at most max_position_embeddings."""
    if settings.context is not None and not 1 <= settings.context <= max_context:
        raise FermijitError(f"--ctx must be between 1 and {max_context} "
                            f"(max_position_embeddings), got {settings.context}")
    context = settings.context or min(max_context, n_prompt + settings.max_tokens)
    if n_prompt > context:
        where = "--ctx" if settings.context else "max_position_embeddings"
        raise FermijitError(f"the prompt has {n_prompt} tokens, more than the context of "
                            f"{context} ({where})")
    return context


def run(model_dir: Path, prompt_text: str, settings: Settings, out=None, err=None) -> Stats:
    """`generate` for the CLI: the continuation streams to `out` (bytes, default stdout) as
    UTF-8, progress and the summary go to `err` (text, default stderr)."""
    from fermijit.model.forward import load_model
    from fermijit.model.tokenizer import Tokenizer
    from fermijit.ops.sampling import Sampler

    out = out or sys.stdout.buffer
    err = err or sys.stderr
    start = time.perf_counter()
    cfg, model = load_model(model_dir, show_progress=True)
    tokenizer = Tokenizer(model_dir, cfg.text_config.eos_token_id)
    load_s = time.perf_counter() - start

    if settings.is_chat:
        prompt = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": prompt_text}]),
                                  add_special_tokens=False)
    else:
        prompt = tokenizer.encode(prompt_text)
    if prompt.size == 0:
        raise FermijitError("the prompt is empty (no tokens)")
    context = context_length(settings, int(prompt.size), model.max_context)
    temperature, top_k, top_p = sampling_settings(settings, tokenizer.generation_config)

    def new_sampler() -> Sampler:
        return Sampler(model.vocab_size, temperature=temperature, top_k=top_k, top_p=top_p,
                       seed=settings.seed)

    sampler = new_sampler()  # checks the settings before any output
    kind = "4-bit fermijit" if model.is_quantized else "fp32 HF checkpoint, unquantised"
    print(f"loaded {model_dir} ({kind}) in {load_s:.2f} s", file=err, flush=True)
    warm_up_s = warm_up(model, prompt, sampler=new_sampler())  # a twin: warming draws from it
    print(f"kernels ready in {warm_up_s:.2f} s", file=err, flush=True)

    stream = tokenizer.stream()

    def write(text: str) -> None:
        try:
            out.write(text.encode("utf-8"))
            out.flush()
        except OSError as e:  # stdout on /dev/full, a closed pipe (issue 11 case 8)
            raise FermijitError(f"cannot write the generated text: {e.strerror}") from None

    def emit(token: int) -> None:
        text = stream.push(token)
        if text:
            write(text)

    _, stats = generate(model, prompt, sampler, settings.max_tokens, context, tokenizer.eos_ids,
                        emit, progress_to=err)
    write(stream.flush())
    print(("\n" if getattr(out, "isatty", lambda: False)() else "") + stats.summary(), file=err)
    return stats
