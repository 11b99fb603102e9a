"""Text <-> tokens: `tokenizer.json` through the `tokenizers` library, the chat template of
`tokenizer_config.json` rendered with jinja2, the stop ids of `generation_config.json`, and an
incremental detokeniser for streaming.

Streaming decodes a growing window of tokens and emits only text that is final: a byte-level BPE
token can end inside a multi-byte UTF-8 character, which decodes to U+FFFD until the token that
completes it arrives (the scheme of HF text-generation-inference's `decode_token`).
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from datetime import datetime
from pathlib import Path

import numpy as np

from fermijit import FermijitError
from fermijit.model.files import MAX_JSON_BYTES, open_regular, read_bytes, read_json, short

# Chat templates render in milliseconds; a loop that does not end, or output past the size of
# any context (262144 tokens is ~1 MB of text), is a broken or hostile template (issue 11 case 11).
TEMPLATE_TIMEOUT_S = 2.0
MAX_TEMPLATE_OUTPUT = 4 << 20
# Address space a render on the main thread (the CLI's) may add: a bound on whatever a step of
# the template allocates. Not on other threads (the server's request handlers): the limit is the
# process's, and the scheduler's thread reserving a long KV cache meanwhile failed (a 500 for an
# unrelated request; tests/fermijit/server/test_soak.py). There the sandbox's own bounds hold
# (`_bounded_sandbox_class`: repetition, concatenation, `~`, `%`, counts and widths), with the
# output limit and the deadline checked between output pieces.
TEMPLATE_MEMORY_NBYTES = 1 << 30

INCOMPLETE = "\ufffd"  # what a cut multi-byte character decodes to


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _check_sampling(gen: dict, where: str) -> dict:
    """generation_config.json's sampling fields are numbers (top_k a whole one) and do_sample a
    boolean, where present: a value of another kind had been passed over for the default (top_k
    0.5 taken as 0, all tokens) without a word. Their ranges are the sampler's to check."""
    for key in ("temperature", "top_p", "top_k"):
        value = gen.get(key)
        if value is None:
            continue
        whole = key == "top_k"
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not is_number or (whole and not float(value).is_integer()):
            kind = "a whole number" if whole else "a number"
            raise FermijitError(f"{where}: {key} must be {kind}, got {short(value)}")
    if gen.get("do_sample") not in (None, True, False):
        raise FermijitError(f"{where}: do_sample must be true or false, got "
                            f"{short(gen['do_sample'])}")
    return gen


def _ids(value, where: str) -> tuple[int, ...]:
    ids = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise FermijitError(f"{where}: eos_token_id must be an int or a list of ints")
    return tuple(ids)


# The chat template's variables render_chat sets itself (and its globals): a request's
# chat_template_kwargs may not name them (fermijit/server/protocol.py).
TEMPLATE_NAMES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token",
                            "raise_exception", "strftime_now"})


class Tokenizer:
    """A model directory's tokenizer, chat template and stop ids."""

    def __init__(self, directory: str | Path, config_eos: int | tuple[int, ...] | None = None,
                 model_vocab: int | None = None):
        """`model_vocab`: the model's vocab_size, which the tokenizer's ids must fit (fewer
        tokens are fine: real models pad their vocabulary)."""
        from tokenizers import Tokenizer as HfTokenizer

        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.exists():
            raise FermijitError(f"{directory}: no tokenizer.json")
        with open_regular(path) as f:
            data = f.read()
        try:
            # From the bytes, not the path: the library takes the path as UTF-8 text, and a
            # directory whose name is not ("not a readable tokenizer ('utf-8' codec can't
            # encode characters ...)") failed every model command
            self._tok = HfTokenizer.from_buffer(data)
        except Exception as e:  # the library raises its own untyped exceptions
            message = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise FermijitError(f"{path}: not a readable tokenizer ({message})") from None
        if model_vocab is not None and self.vocab_size > model_vocab:  # else found at encode
            raise FermijitError(f"{path}: {self.vocab_size} tokens, more than the model's "
                                f"vocab_size {model_vocab} (config.json): the tokenizer of "
                                f"another model?")
        cfg_path = directory / "tokenizer_config.json"
        cfg = read_json(cfg_path) if cfg_path.exists() else {}
        self.chat_template = self._find_template(directory, cfg)
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        gen_path = directory / "generation_config.json"
        gen = read_json(gen_path) if gen_path.exists() else {}
        self.generation_config = _check_sampling(gen, str(gen_path))
        eos = _ids(gen.get("eos_token_id"), str(gen_path)) or _ids(config_eos, "config.json")
        self.eos_ids = frozenset(eos)

    @staticmethod
    def _find_template(directory: Path, cfg: dict) -> str | None:
        """tokenizer_config.json's `chat_template` (a string, or named templates: "default"),
        else chat_template.jinja (where newer HF exports keep it)."""
        template = cfg.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_path = directory / "chat_template.jinja"
        if template is None and jinja_path.exists():
            try:
                template = read_bytes(jinja_path, MAX_JSON_BYTES, "template").decode("utf-8")
            except UnicodeDecodeError as e:
                raise FermijitError(f"{jinja_path}: not UTF-8 ({e.reason} at byte {e.start})") \
                    from None
        return template if isinstance(template, str) else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        """int32 [T]. Special tokens written in `text` (e.g. from a chat template) are matched."""
        if not isinstance(text, str):
            raise FermijitError(f"the text to encode is a {type(text).__name__}, not a str")
        # encode_batch lets go of the GIL while it works, encode does not: a server thread
        # tokenising a 4 MB prompt (~10 s here) stopped the scheduler's thread for all of it.
        (encoding,) = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
        return np.array(encoding.ids, dtype=np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    variables: dict | None = None) -> str:
        """The chat template applied to `messages` ([{"role", "content"}]), as HF's
        apply_chat_template renders it (sandboxed jinja2, trim_blocks, lstrip_blocks);
        `variables`: more of the template's variables (a request's chat_template_kwargs, e.g.
        Qwen3's enable_thinking), never replacing those set here (TEMPLATE_NAMES)."""
        if self.chat_template is None:
            raise FermijitError("--chat: the model has no chat template (tokenizer_config.json "
                                "chat_template or chat_template.jinja)")
        import jinja2

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                              extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = env.checked(tojson)  # indent
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            with _time_limit(TEMPLATE_TIMEOUT_S) as limit:
                env.globals["range"] = _DeadlineRange.of(limit)
                pieces, n_chars = [], 0
                for piece in env.from_string(self.chat_template).generate({
                        **(variables or {}), "messages": messages,
                        "add_generation_prompt": add_generation_prompt,
                        "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}):
                    limit.check()
                    n_chars += len(piece)
                    if n_chars > MAX_TEMPLATE_OUTPUT:
                        raise _TemplateLimit(f"output past {MAX_TEMPLATE_OUTPUT >> 20} MiB")
                    pieces.append(piece)
                return "".join(pieces)
        except jinja2.exceptions.TemplateError as e:
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise FermijitError(f"chat template: {message}") from None
        except _TemplateLimit as e:
            raise FermijitError(f"chat template: {e}") from None
        except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError,
                RecursionError, MemoryError) as e:
            # A template can raise any Python error ({{ 1/0 }}): it is the model's fault.
            raise FermijitError(f"chat template: {type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}") from None

    def stream(self) -> "StreamDecoder":
        return StreamDecoder(self)


class _TemplateLimit(Exception):
    pass


class _DeadlineRange:
    """The sandbox's `range` (jinja2 safe_range: at most 100,000 items) whose loops check the
    render's deadline at every step: off the main thread no timer interrupts a render, and two
    nested loops of 100,000 with no output between them ran for minutes."""

    def __init__(self, r: range, limit):
        self.r, self.limit = r, limit

    @classmethod
    def of(cls, limit):
        from jinja2.sandbox import safe_range

        return lambda *args: cls(safe_range(*args), limit)

    def __len__(self):
        return len(self.r)

    def __getitem__(self, i):
        return self.r[i]

    def __iter__(self):
        for i in self.r:
            self.limit.check()
            yield i


def _too_big(n: int, what: str) -> None:
    if n > MAX_TEMPLATE_OUTPUT:
        raise _TemplateLimit(f"{what} past the output limit")


def _checked_counts(args) -> None:
    for a in args:
        if isinstance(a, int) and a > MAX_TEMPLATE_OUTPUT:
            raise _TemplateLimit(f"a count or width of {a}")


def _checked_format(fmt: str, args) -> None:
    """`fmt % args` (the `%` operator, the `format` filter): no width or precision, written or
    taken from the arguments, past the output limit."""
    _checked_counts(args if isinstance(args, tuple) else (args,))
    for n in re.findall(r"%[-+ #0]*(\d*)(?:\.(\d*))?", fmt):
        _checked_counts(int(x) for x in n if x)


def _bounded_replace(s, old, new, count=-1):
    """str.replace that refuses a result past the output limit before building it."""
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        n = s.count(old) if old else len(s) + 1
        _too_big(len(s) + (n if count < 0 else min(n, count)) * (len(new) - len(old)),
                 "a replacement")
    return s.replace(old, new, count)


def _bounded_sandbox_class():
    import functools

    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedGenerator(CodeGenerator):
        def visit_Concat(self, node, frame) -> None:
            """`a ~ b`: through the environment's `bounded_concat`, not jinja2's str_join,
            which the sandbox cannot intercept (a doubling loop reached gigabytes between two
            of the deadline's checks)."""
            self.write("environment.bounded_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        """jinja2's sandbox, with `*`, `**`, `+`, `~` and `%` (and calls and filters with a huge
        count or width: str.center, ljust, zfill, |indent; replacements) unable to build one
        giant value in a single step, where no timer can interrupt them: `'a' * 2000000000`
        took a minute to fail."""

        code_generator_class = BoundedGenerator
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            checked = self.checked
            self.filters = {name: checked(f) for name, f in self.filters.items()}
            self.filters["replace"] = checked(lambda s, old, new, count=None: _bounded_replace(
                str(s), str(old), str(new), -1 if count is None else count))
            self.filters["format"] = checked(lambda fmt, *args, **kwargs: (
                _checked_format(fmt, args or kwargs), fmt % (args or kwargs))[1])

        @staticmethod
        def checked(f):
            """Filter `f` refusing a count or width past the output limit."""
            @functools.wraps(f)  # keeps jinja2's pass_context / pass_eval_context marks
            def filter_(*args, **kwargs):
                _checked_counts((*args, *kwargs.values()))
                return f(*args, **kwargs)
            return filter_

        @staticmethod
        def bounded_concat(parts) -> str:
            parts = [str(p) for p in parts]
            _too_big(sum(map(len, parts)), "a concatenation")
            return "".join(parts)

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                n = right if isinstance(right, int) else left if isinstance(left, int) else 1
                other = left if n is right else right
                if isinstance(other, (str, list, tuple)) and len(other) * n > MAX_TEMPLATE_OUTPUT:
                    raise _TemplateLimit("a repetition past the output limit")
            elif operator == "+" and isinstance(left, (str, list, tuple)) and \
                    isinstance(right, type(left)) and len(left) + len(right) > MAX_TEMPLATE_OUTPUT:
                raise _TemplateLimit("a concatenation past the output limit")
            elif operator == "**" and isinstance(right, int) and right > 1024:
                raise _TemplateLimit(f"an exponent of {right}")
            elif operator == "%" and isinstance(left, str):
                _checked_format(left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's signature)
            _checked_counts((*args, *kwargs.values()))
            if getattr(__obj, "__name__", "") == "replace" and isinstance(
                    getattr(__obj, "__self__", None), str):
                return _bounded_replace(__obj.__self__, *args, **kwargs)
            return super().call(__context, __obj, *args, **kwargs)

    return BoundedSandbox


class _LazyBoundedSandbox:
    """The sandbox class, made on first use (jinja2 imported only for --chat)."""

    def __call__(self, **kwargs):
        return _bounded_sandbox_class()(**kwargs)


_BoundedSandbox = _LazyBoundedSandbox()


def _address_space_nbytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# The address-space cap is the process's: renders on several threads (the server's request
# handlers) take turns, or one's exit would restore a limit another had lowered.
_RENDER_LOCK = threading.Lock()


class _time_limit:
    """Raise _TemplateLimit after `seconds` (SIGALRM: the main thread only; elsewhere `check`,
    called between output pieces, and the output and repetition limits hold), and cap the address
    space the render may add (a failed allocation is a MemoryError)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.armed = threading.current_thread() is threading.main_thread()
        self.previous_limit = None
        self.deadline = time.monotonic() + seconds

    def _expired(self, signum, frame):
        raise _TemplateLimit(f"rendering took more than {self.seconds:g} s")

    def check(self) -> None:
        if time.monotonic() > self.deadline:
            self._expired(None, None)

    def __enter__(self):
        _RENDER_LOCK.acquire()
        self.deadline = time.monotonic() + self.seconds
        if self.armed:
            self.previous = signal.signal(signal.SIGALRM, self._expired)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        if not self.armed:
            return self
        import resource

        used = _address_space_nbytes()
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        if used is not None:
            cap = used + TEMPLATE_MEMORY_NBYTES
            if (hard == resource.RLIM_INFINITY or cap <= hard) and (
                    soft == resource.RLIM_INFINITY or cap < soft):
                resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
                self.previous_limit = (soft, hard)
        return self

    def __exit__(self, *exc):
        if self.previous_limit is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_AS, self.previous_limit)
        if self.armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
        _RENDER_LOCK.release()
        return False


class StreamDecoder:
    """Tokens in, final text out: `push` returns what the new token completes (maybe ""),
    `flush` whatever is left at the end (an incomplete character as U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0   # ids[prefix:read] decode to text already emitted, as context
        self._read = 0     # ids[read:] have not been emitted

    def push(self, token: int) -> str:
        self._ids.append(int(token))
        done = self._tokenizer.decode(self._ids[self._prefix:self._read])
        text = self._tokenizer.decode(self._ids[self._prefix:])
        if len(text) <= len(done) or text.endswith(INCOMPLETE):
            return ""  # nothing new, or a character cut in two: wait for the next token
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(done):]

    def flush(self) -> str:
        done = self._tokenizer.decode(self._ids[self._prefix:self._read])
        text = self._tokenizer.decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(done):]
