"""The generate loop (DESIGN.md, Data flow of `generate`): tokenize, prefill the prompt, decode
one token at a time, sample, detokenise and stream; timings and peak memory on the side.

`generate` is the loop on token ids; `Engine` holds a model, its tokenizer's end ids and sampling
defaults and its snapshot prefix cache (fermijit/cache/prefix_cache.py), and is what any caller uses
(`Engine.generate(prompt_ids, settings, on_token)`); `run` is what `python -m fermijit generate`
calls: load an Engine, settle the settings, stream text to stdout and the summary to stderr.
With a cache, the prompt resumes from its longest cached prefix and only the rest is prefilled;
snapshots are taken every `snapshot_every` positions of the prefill, at the end of the prompt
and at the end of the generation. The prompt is prefilled by a `hybrid` prefiller chosen
once (`--prefill cpu|gpu|auto`: the GPU with experts streamed from host memory, or the CPU);
decode runs on the CPU.
"""

from __future__ import annotations

import dataclasses
import enum
import resource
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fermijit import FermijitError
# The warm-up lives in fermijit/warm.py; callers know it as engine.warm_up.
from fermijit.warm import WARM_UP_TOKENS, kernel_sample, warm_up  # noqa: F401

# HF GenerationConfig's defaults, used where the model's generation_config.json says nothing.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_K = 50
DEFAULT_TOP_P = 1.0
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
    prefill: str = "auto"         # --prefill cpu|gpu|auto (fermijit/prefill/hybrid.py)
    gpu_mem: str | None = None    # --gpu-mem, e.g. "6G" (default: free less a margin)
    pin_budget: str | None = None  # --pin-budget (default: half the host's RAM)
    verbose: bool = False         # --verbose: the GPU prefill's memory plan on stderr
    images: tuple = ()            # --image paths: in the user turn, before the text (chat)
    max_image_tokens: int | None = None  # --max-image-tokens (default: model/image.py's)
    drafts: object = None         # --speculative mtp: a speculative.Drafts; None: off


@dataclasses.dataclass
class Stats:
    n_prompt: int = 0
    n_cached: int | None = None  # prompt tokens restored from the cache; None without one
    prefill_s: float = 0.0
    n_generated: int = 0        # tokens streamed (the eos that stops is not one)
    n_decode_steps: int = 0     # forwards: of one token, or speculative verify steps
    n_decode_tokens: int = 0    # tokens the decode loop sampled (the eos that stops included)
    decode_s: float = 0.0       # the decode loop, sampling and streaming included
    stop: Stop | None = None
    speculative: object = None  # speculative.Counts with --speculative mtp

    @property
    def prefill_tok_per_s(self) -> float:
        """Tokens prefilled (not restored from the cache) per second."""
        n_prefilled = self.n_prompt - (self.n_cached or 0)
        return n_prefilled / self.prefill_s if self.prefill_s else float("nan")

    @property
    def decode_tok_per_s(self) -> float:
        return self.n_decode_tokens / self.decode_s if self.decode_s else float("nan")

    def summary(self) -> str:
        cached = "" if self.n_cached is None else f" ({self.n_cached} from the cache)"
        rate = (f"{self.prefill_tok_per_s:.1f} tok/s" if self.n_cached != self.n_prompt
                else "restored")
        spec = self.speculative
        drafts = ("" if spec is None else
                  f", {self.n_decode_tokens / max(spec.steps, 1):.2f} tok/step, "
                  + (f"{100 * spec.acceptance:.0f}% of {spec.drafted} drafts accepted"
                     if spec.drafted else "no drafts made"))
        return (f"prompt {self.n_prompt} tokens{cached}; prefill {self.prefill_s:.3f} s "
                f"({rate}); generated {self.n_generated} tokens, "
                f"decode {self.decode_tok_per_s:.1f} tok/s{drafts} ({self.stop.value}); "
                f"peak RSS {peak_rss_bytes() / 2**20:.0f} MiB")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def generate(model, prompt: np.ndarray, sampler, max_tokens: int, context: int,
             eos_ids: frozenset[int], on_token: Callable[[int], None],
             progress_to=None, cache=None, prefiller=None,
             drafts=None) -> tuple[list[int], Stats]:
    """Prefill `prompt` (through `prefiller`, default the CPU's), then sample and decode until an
    eos id, `max_tokens` or the end of the context; `on_token` gets each generated token as it is
    made. Returns (tokens, stats). With `progress_to` (a text stream), a prompt of several prefill
    passes shows a progress bar there. With `cache` (a prefix_cache.PrefixCache of this model),
    the prompt resumes from its longest cached prefix, and the state is snapshotted on the way
    and at the end. `prompt` may be a model/multimodal.py Prompt (with images): prefilled on the
    CPU, without the cache (an image's placeholder ids do not say which image it was).
    `drafts`: a speculative.Drafts, decoding speculatively with the model's MTP head
    (fermijit/speculative.py; the cache then holds states with its layer:
    Engine.load(speculative=True)); None: plainly. A prompt with images decodes plainly (the
    head's rows of image tokens are not computed)."""
    from fermijit.model import multimodal

    stats = Stats(n_prompt=int(prompt.size))
    start = time.perf_counter()
    if isinstance(prompt, multimodal.Prompt):
        state = model.new_state(context, int(prompt.size) + max_tokens)
        cache, n_cached, drafts = None, 0, None
        logits = multimodal.prefill(model, prompt, state)
        prompt = prompt.ids
    else:
        prompt = np.asarray(prompt, np.int32)
        state, logits, n_cached = prefill(model, prompt, context, cache, progress_to, prefiller,
                                          prompt.size + max_tokens, mtp=drafts is not None)
    stats.n_cached = None if cache is None else n_cached
    token = sampler.sample(logits)
    stats.prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    if drafts is not None:
        from fermijit.speculative import Speculator

        speculator = Speculator(model, sampler, drafts)
        tokens, logits = _decode_speculative(speculator, state, token, max_tokens, context,
                                             eos_ids, on_token, stats)
        speculator.settle(state)
        stats.speculative = speculator.counts
    else:
        tokens, logits = _decode(model, state, token, logits, sampler, max_tokens, context,
                                 eos_ids, on_token, stats)
    stats.decode_s = time.perf_counter() - start
    stats.n_generated = len(tokens)
    if cache is not None and state.position > prompt.size:  # what was fed: the prompt and answer
        fed = np.concatenate([prompt, np.asarray(tokens[:state.position - prompt.size],
                                                 np.int32)])
        cache.add(fed, state, logits)
    return tokens, stats


def _decode(model, state, token, logits, sampler, max_tokens, context, eos_ids, on_token,
            stats) -> tuple[list[int], np.ndarray]:
    """The decode loop from `token` (sampled from `logits`): (the tokens generated, the logits
    after the last fed)."""
    tokens: list[int] = []
    while True:
        if token in eos_ids:
            stats.stop = Stop.EOS
            break
        tokens.append(token)
        on_token(token)
        if len(tokens) == max_tokens:
            stats.stop = Stop.MAX_TOKENS
            break
        if state.position + 1 == context:  # the prompt and the tokens generated fill it (`fits`)
            stats.stop = Stop.CONTEXT
            break
        logits = model.decode(token, state)
        token = sampler.sample(logits)
        stats.n_decode_steps += 1
        stats.n_decode_tokens += 1
    return tokens, logits


def _decode_speculative(speculator, state, token, max_tokens, context, eos_ids, on_token,
                        stats) -> tuple[list[int], np.ndarray | None]:
    """`_decode` by draft-and-verify steps: each step's tokens are taken one at a time exactly
    as `_decode` takes them, and where the generation stops inside a step, the state is taken
    back to what `_decode` would have fed (Speculator.truncate). Returns (the tokens, the logits
    after the last fed; None when nothing was fed)."""
    tokens: list[int] = []
    new, logits = [token], None
    while True:
        base = state.position - len(new)  # where the step's first fed token went
        for i, t in enumerate(new):
            stop = None
            if t in eos_ids:
                stop = Stop.EOS
            else:
                tokens.append(t)
                on_token(t)
                if len(tokens) == max_tokens:
                    stop = Stop.MAX_TOKENS
                elif base + i + 2 == context:  # as `_decode`'s
                    stop = Stop.CONTEXT
            if stop is not None:
                stats.stop = stop
                if logits is not None:          # the step fed i + 1 of its tokens
                    logits = speculator.truncate(state, i + 1)
                return tokens, logits
        new, logits = speculator.step(state, new[-1])
        stats.n_decode_steps += 1
        stats.n_decode_tokens += len(new)


def prefill(model, prompt: np.ndarray, context: int, cache=None, progress_to=None,
            prefiller=None, positions: int | None = None, mtp: bool = False):
    """(state, logits, n_cached): the state after `prompt` with its KV caches allocated to
    `context` (taking memory as used: `positions` of them checked now, default all), the logits
    after it, and how many of its tokens were restored from `cache` (the longest cached prefix;
    the rest is prefilled by `prefiller`, default the CPU's, snapshotted on the way and at the
    end). With `mtp`, the state carries the MTP layer (model/mtp.py)."""
    from fermijit.model.forward import PREFILL_BLOCK
    from fermijit.prefill.hybrid import CpuPrefiller

    p = PromptPrefill(model, prompt, context, cache, positions, mtp)
    if p.logits is None:
        prefiller = prefiller or CpuPrefiller(model)
        bar = on_block = None
        if progress_to is not None and p.rest.size > PREFILL_BLOCK:
            # Every pass shown (mininterval 0): passes are few, and a fast one came within
            # tqdm's default 0.1 s of the start and was never drawn.
            bar = tqdm(total=int(p.rest.size), desc="prefill", unit="tok", file=progress_to,
                       leave=False, mininterval=0)

            def on_block(n: int) -> None:
                bar.update(n)
                p.on_block(n)
        try:
            logits = prefiller.prefill(p.rest, p.state, on_block=on_block or p.on_block,
                                       align=p.align)
        finally:
            if bar is not None:
                bar.close()
        p.finish(logits)
    return p.state, p.logits, p.n_cached


class PromptPrefill:
    """One prompt's prefill, whole (`prefill`) or in pieces (the server's chunks:
    fermijit/server/scheduler.py): its state, restored from the longest prefix `cache` holds
    (with the logits when that is the whole prompt), KV caches allocated to `context`; the
    tokens left (`rest`); snapshots where a pass ends at a multiple of `snapshot_every` (passes
    are aligned to them: `align`) or `snapshot_every` past the last one (a prefill that cannot
    align), and at the end (`finish`). With `mtp`, the state carries the MTP layer
    (model/mtp.py). `gdn`: a new state's GDN layers from it (Model.new_state; the server's
    pool of resident ones)."""

    def __init__(self, model, prompt: np.ndarray, context: int, cache=None,
                 positions: int | None = None, mtp: bool = False, gdn=None):
        self.prompt, self.cache = np.asarray(prompt, np.int32), cache
        state, self.logits = (None, None) if cache is None else cache.restore(self.prompt,
                                                                               context)
        self.state = model.new_state(context, positions, mtp, gdn) if state is None else state
        self.n_cached = self._last_snapshot = self.state.position

    @property
    def rest(self) -> np.ndarray:
        """The prompt's tokens the state has not seen."""
        return self.prompt[self.state.position:]

    @property
    def align(self) -> int | None:
        return None if self.cache is None else self.cache.snapshot_every

    def on_block(self, n: int) -> None:
        """A pass of n tokens has ended: snapshot here if due."""
        cache, position = self.cache, self.state.position
        # The end is `finish`'s; a GPU prefill hands the state back at its end, so a pass may
        # end with the state not yet moved: no snapshot of that.
        if cache is None or position == self.prompt.size or position == self._last_snapshot:
            return
        if position % cache.snapshot_every == 0 or \
                position - self._last_snapshot >= cache.snapshot_every:
            cache.add(self.prompt[:position], self.state)
            self._last_snapshot = position

    def finish(self, logits: np.ndarray) -> None:
        """The whole prompt prefilled, `logits` after it: snapshot it."""
        if self.cache is not None:
            self.cache.add(self.prompt, self.state, logits)
        self.logits = logits


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


def fits(n_prompt: int, max_tokens: int | None, context: int) -> bool:
    """The one rule of `generate` and the server (server/prompts.py): the context holds the
    prompt and the tokens generated after it together (as vLLM's max_model_len; `generate`
    stops there, "context full"), and at least one generated token (`max_tokens` None: one)
    must fit: a prompt that fills the context is refused."""
    return n_prompt + (max_tokens or 1) <= context


def context_length(settings: Settings, n_prompt: int, max_context: int) -> int:
    """The context (the prompt and the tokens generated: `fits`): --ctx, else prompt +
    max_tokens, at most max_position_embeddings."""
    if settings.context is not None and not 1 <= settings.context <= max_context:
        raise FermijitError(f"--ctx must be between 1 and {max_context} "
                            f"(max_position_embeddings), got {settings.context}")
    context = settings.context or min(max_context, n_prompt + settings.max_tokens)
    if not fits(n_prompt, None, context):
        where = "--ctx" if settings.context else "max_position_embeddings"
        raise FermijitError(f"the prompt has {n_prompt} tokens, and at least 1 to generate: "
                            f"more than the context of {context} ({where})")
    return context


class Engine:
    """A model ready to generate from token ids: its tokenizer (end ids, sampling defaults) and its
    snapshot prefix cache (None: off). What the CLI and any other caller (the server) use."""

    def __init__(self, model, tokenizer, cache=None, prefiller=None, config=None,
                 directory: Path | None = None, speculative: bool = False):
        self.model, self.tokenizer, self.cache = model, tokenizer, cache
        # Whether its states carry the MTP layer (speculative decoding, fermijit/speculative.py):
        # so do the cache's snapshots, under their own fingerprint.
        self.speculative = speculative
        self.prefiller = prefiller  # fermijit/prefill/hybrid.py; None: the CPU's
        # For images (model/multimodal.py): the whole config.json, and where the tower's
        # weights and preprocessor_config.json are; the tower is loaded on first use.
        self.config, self.directory = config, directory
        self._tower = None
        # Image prompts may be made on several threads (the server's handlers): one at a time
        # loads and runs the tower (it is a team of threads itself).
        self._vision_lock = threading.RLock()

    @classmethod
    def load(cls, model_dir: Path, cache_settings=None, show_progress: bool = False,
             warn=None, kv=None, speculative: bool | None = False,
             on_model=None) -> "Engine":
        """Load a model directory; `cache_settings` (prefix_cache.CacheSettings, default: on, in
        memory only) says how to cache; `warn(line)` takes the cache's warnings (stderr); `kv`
        the KV cache's kind (model.state.KvKind, default Q8_0); `speculative`: decode with the
        model's MTP head (FermijitError if it has none; None: where it has one and it pays:
        speculative.pays); `on_model(model)` as soon as the model is loaded, before the
        tokenizer and the cache (the server starts the GPU's preparation there)."""
        from fermijit.cache import prefix_cache
        from fermijit.model.forward import load_model
        from fermijit.model.state import DEFAULT_KV
        from fermijit.model.tokenizer import Tokenizer

        kv = kv or DEFAULT_KV
        cfg, model = load_model(model_dir, show_progress=show_progress, kv=kv)
        if on_model is not None:
            on_model(model)
        if speculative is None:
            from fermijit.speculative import pays

            speculative = model.mtp is not None and pays(model)
        if speculative and model.mtp is None:
            why = ("config.json's mtp_num_hidden_layers is 0"
                   if cfg.text_config.mtp_num_hidden_layers == 0 else
                   "mtp.* weights; a model converted before fermijit kept them has none: "
                   "convert it again")
            raise FermijitError(f"--speculative mtp: {model_dir} has no MTP head ({why})")
        tokenizer = Tokenizer(model_dir, cfg.text_config.eos_token_id, model.vocab_size)
        c = prefix_cache.CacheSettings() if cache_settings is None else cache_settings
        cache = None
        if c.is_enabled:
            fingerprint = prefix_cache.model_fingerprint(model_dir, kv, speculative,
                                                         hash_data=c.directory is not None)
            cache = prefix_cache.PrefixCache(fingerprint,
                                             c.mem_bytes, c.directory, c.snapshot_every,
                                             check=model.check_state, warn=warn, key=c.key)
        return cls(model, tokenizer, cache, config=cfg, directory=Path(model_dir),
                   speculative=speculative)

    def image_prompt(self, messages: list[dict], images: list, encode=None,
                     max_image_tokens: int | None = None,
                     check: Callable[[int], None] | None = None, variables: dict | None = None):
        """A model/multimodal.py Prompt (what `generate` takes) from chat `messages` whose
        content may hold {"type": "image"} or {"type": "image_url"} parts, and `images` for them
        in order: paths, model/image.py Encoded images (the server's data: URIs) or PIL images.
        Before any image is decoded, its tokens are known from its size: more than
        `max_image_tokens` in all (default model/image.py DEFAULT_MAX_IMAGE_TOKENS) is a
        FermijitError, and `check(n_prompt)` (raising when the
        context cannot hold it) sees the prompt's length. `encode` replaces the tower's CPU
        encode (the GPU's: model/vision_gpu.py). `variables`: the chat template's extra
        variables (Tokenizer.render_chat)."""
        from fermijit.model import image, multimodal

        max_image_tokens = max_image_tokens or image.DEFAULT_MAX_IMAGE_TOKENS
        with self._vision_lock:
            tower = self.vision_tower() if images else None
            settings = image.image_settings(self.directory, self.config.vision_config)
            images = [image.open_image(im) if isinstance(im, (str, Path)) else im
                      for im in images]
            layouts = [image.layout(im, settings) for im in images]
            n_image = sum(layout.n_tokens for layout in layouts)
            if n_image > max_image_tokens:
                sizes = ", ".join(f"{im.width}x{im.height}" for im in images
                                  if isinstance(im, image.Encoded))
                many = len(images) > 1
                raise FermijitError(f"the image{'s' if many else ''} ({sizes or 'given'}) "
                                    f"make{'' if many else 's'} {n_image} image tokens, more "
                                    f"than the {max_image_tokens} allowed (--max-image-tokens)")
            ids = multimodal.render(self.tokenizer, messages, layouts, self.config, variables)
            if check is not None:
                check(int(ids.size))
            processed = [image.preprocess(im, settings) if not isinstance(im, image.Image)
                         else im for im in images]
            assert [p.grid for p in processed] == [layout.grid for layout in layouts]
            embeds = (encode or tower.encode)(processed) if processed else None
            return multimodal.build(ids, processed, embeds, self.config)

    @property
    def has_vision(self) -> bool:
        """Whether the model's config has a vision tower (its weights may still be missing)."""
        return self.config is not None and self.config.vision_config is not None

    def vision_tower(self):
        """The model's vision tower (model/vision.py), loaded on first use."""
        from fermijit.model import multimodal

        if self.config is None or self.directory is None:
            raise FermijitError("this engine was made without its model directory: no images")
        with self._vision_lock:
            if self._tower is None:
                self._tower = multimodal.load_tower(self.directory, self.config)
                if self._tower is None:
                    raise FermijitError(f"{self.directory} has no vision tower (no model.visual "
                                        f"tensors): it cannot take images")
            return self._tower

    def sampler(self, settings: Settings):
        """A sampler as `settings` and the model's generation_config.json say (checks them)."""
        from fermijit.ops.sampling import Sampler

        temperature, top_k, top_p = sampling_settings(settings, self.tokenizer.generation_config)
        return Sampler(self.model.vocab_size, temperature=temperature, top_k=top_k, top_p=top_p,
                       seed=settings.seed)

    def generate(self, prompt_ids, settings: Settings, on_token: Callable[[int], None],
                 progress_to=None) -> tuple[list[int], Stats]:
        """Continue the token ids `prompt_ids` (or an `image_prompt`) as `settings` say;
        `on_token` gets each new one."""
        from fermijit.model.multimodal import Prompt

        prompt = prompt_ids if isinstance(prompt_ids, Prompt) else np.asarray(prompt_ids, np.int32)
        ids = prompt.ids if isinstance(prompt, Prompt) else prompt
        if ids.ndim != 1 or ids.size == 0:
            raise FermijitError("the prompt is empty (no tokens)")
        context = context_length(settings, int(prompt.size), self.model.max_context)
        if settings.drafts is not None and not self.speculative:
            raise FermijitError("this engine was loaded without speculative decoding "
                                "(Engine.load(speculative=True))")
        return generate(self.model, prompt, self.sampler(settings), settings.max_tokens, context,
                        self.tokenizer.eos_ids, on_token, progress_to, self.cache,
                        self.prefiller, drafts=settings.drafts)


def run(model_dir: Path, prompt_text: str, settings: Settings, out=None, err=None,
        cache_settings=None, kv=None) -> Stats:
    """`generate` for the CLI: the continuation streams to `out` (bytes, default stdout) as
    UTF-8, progress and the summary go to `err` (text, default stderr); `kv` the KV cache's
    kind (default Q8_0)."""
    from fermijit.prefill import hybrid

    hybrid.parse_bytes(settings.gpu_mem), hybrid.parse_bytes(settings.pin_budget)  # bad: early
    out = out or sys.stdout.buffer
    err = err or sys.stderr
    from fermijit.model import files, image

    pictures = [image.open_image(path) for path in settings.images]  # bad files: before loading
    start = time.perf_counter()
    engine = Engine.load(model_dir, cache_settings, show_progress=True,
                         warn=lambda line: print(line, file=err, flush=True), kv=kv,
                         speculative=settings.drafts is not None)
    model, tokenizer = engine.model, engine.tokenizer
    load_s = time.perf_counter() - start

    if pictures:
        start = time.perf_counter()
        encode, where = None, "CPU"
        if settings.prefill != "cpu":  # --prefill gpu|auto: the tower on the GPU where usable
            from fermijit.model import vision_gpu

            if vision_gpu.usable():
                encode, where = vision_gpu.make(engine.vision_tower()).encode, "GPU"
        content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": prompt_text}]
        prompt = engine.image_prompt(
            [{"role": "user", "content": content}], pictures, encode, settings.max_image_tokens,
            check=lambda n_prompt: context_length(settings, n_prompt, model.max_context))
        print(f"{len(pictures)} image(s), {prompt.rows.size} image tokens: vision tower "
              f"({where}) {time.perf_counter() - start:.2f} s", file=err, flush=True)
    elif settings.is_chat:
        prompt = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": prompt_text}]),
                                  add_special_tokens=False)
    else:
        prompt = tokenizer.encode(prompt_text)
    if prompt.size == 0:
        raise FermijitError("the prompt is empty (no tokens)")
    context_length(settings, int(prompt.size), model.max_context)  # checked before any output
    engine.sampler(settings)
    kind = "4-bit fermijit" if model.is_quantized else "fp32 HF checkpoint, unquantised"
    print(f"loaded {model_dir} ({kind}) in {load_s:.2f} s", file=err, flush=True)
    ids = getattr(prompt, "ids", prompt)  # a multimodal.Prompt's, or the ids themselves
    # A prompt with images is prefilled on the CPU (engine.generate): no GPU prefill to set up,
    # nor its weights to take GPU memory beside the vision tower's.
    engine.prefiller = prefiller = hybrid.make(model, "cpu" if pictures else settings.prefill,
                                               settings.gpu_mem, settings.pin_budget,
                                               settings.verbose, err)
    with hybrid.preparing(prefiller) as gpu_ready:  # the GPU's start beside the CPU's warm-up
        warm_up_s = warm_up(model, ids, sampler=engine.sampler(settings))  # a twin: warming draws
        if settings.drafts is not None and not pictures:
            from fermijit import speculative

            start = time.perf_counter()
            speculative.warm_up(model, engine.sampler(settings), settings.drafts)
            warm_up_s += time.perf_counter() - start
    print(f"kernels ready in {warm_up_s:.2f} s", file=err, flush=True)
    if gpu_ready.get("seconds") is not None:
        print(f"gpu prefill ready in {gpu_ready['seconds']:.2f} s", file=err, flush=True)

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

    _, stats = engine.generate(prompt, settings, emit, progress_to=err)
    write(stream.flush())
    print(("\n" if getattr(out, "isatty", lambda: False)() else "") + stats.summary(), file=err)
    files.check_mappings()  # the weights rewritten in place meanwhile: the text is suspect
    return stats
