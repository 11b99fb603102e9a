"""The OpenAI API's wire format: requests checked and turned into a `Job` for the scheduler,
responses and chunks built from its results, errors as OpenAI's error JSON
({"error": {"message", "type", "param", "code"}}) with their HTTP status.

Only n = 1 is served. Fields that would change the answer but are not implemented (penalties,
logprobs, tools, ...) are a 400 unless absent or at their neutral value; other unknown fields
(`user`, `metadata`) are ignored; known ones are checked strictly: a wrong type is a 400.
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections.abc import Callable

MAX_STOP_STRINGS = 4  # OpenAI's limit
# The text that could still grow into a stop string is held back, at a cost per token quadratic
# in its length on the scheduler's thread (scheduler.py StopMatcher): longer ones are a 400.
MAX_STOP_CHARS = 1024
# Fields that would change the answer and are not implemented: a 400 unless absent or neutral
# (clients send some at their defaults), never silently ignored.
UNSUPPORTED = {"frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logprobs": (False,),
               "top_logprobs": (0,), "logit_bias": ({},), "tools": ([],), "functions": ([],),
               "tool_choice": ("none",), "best_of": (1,), "echo": (False,), "suffix": ("",),
               "response_format": ({"type": "text"},),
               # vLLM's and llama.cpp's extensions, which their users send to this server too:
               # each was silently ignored (repetition_penalty 1.2 answered unpenalised)
               "min_p": (0, 0.0), "repetition_penalty": (1, 1.0), "length_penalty": (1, 1.0),
               "min_tokens": (0,), "stop_token_ids": ([],), "bad_words": ([],),
               "allowed_token_ids": (), "use_beam_search": (False,),
               "include_stop_str_in_output": (False,), "prompt_logprobs": (),
               "truncate_prompt_tokens": (), "guided_json": (), "guided_regex": (),
               "guided_choice": (), "guided_grammar": (), "structured_outputs": (),
               "add_generation_prompt": (True,), "continue_final_message": (False,),
               "chat_template": (), "repeat_penalty": (1, 1.0), "typical_p": (1, 1.0),
               "tfs_z": (1, 1.0), "mirostat": (0,), "dynatemp_range": (0, 0.0),
               "xtc_probability": (0, 0.0), "dry_multiplier": (0, 0.0), "n_probs": (0,),
               "grammar": ("",), "json_schema": ({},)}
MAX_SEED = 2 ** 63 - 1
RANDOM_SEED = -1  # llama.cpp's "a random seed", which its clients send by default


class ApiError(Exception):
    """An error response: HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (status, message, param,
                                                                         code, kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def context_overflow(n_prompt: int, max_tokens: int | None, max_context: int,
                     is_chat: bool) -> ApiError:
    asked = f" plus {max_tokens or 'at least 1'} to generate"  # engine.fits
    return ApiError(400, f"This model's maximum context length is {max_context} tokens; the "
                         f"prompt has {n_prompt}{asked}.", "messages" if is_chat else "prompt",
                    "context_length_exceeded")


def server_stopping() -> ApiError:
    """What a request in flight is answered as the server stops (SIGTERM, Ctrl-C)."""
    return ApiError(503, "the server is stopping: retry later", code="server_stopping",
                    kind="server_error")


@dataclasses.dataclass(eq=False)  # a request is itself, as scheduler.py Sequence
class Job:
    """One request as the scheduler takes it. `emit(event)` is called from the scheduler's thread
    (the app makes it thread-safe); `cancelled` is set by the app when the client goes away."""

    is_chat: bool
    prompt: str | list[int] | list[dict]  # text or token ids (completions), messages (chat)
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever (benchmarks)
    images: tuple[str, ...] = ()  # data: URIs of the chat's image parts, in order
    # vLLM's chat_template_kwargs: more variables for the chat template (Qwen3's enable_thinking)
    template_kwargs: dict = dataclasses.field(default_factory=dict)
    # Made by the request's handler (server/prompts.py), off the scheduler's thread: the prompt's
    # token ids (int32 [T], image placeholders included), and with images the whole
    # model/multimodal.py Prompt (the tower's output, MRoPE positions).
    ids: object = None
    image_prompt: object = None
    emit: Callable[[object], None] = print
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)


# --- events, scheduler -> app ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Started:
    n_prompt: int
    n_cached: int


@dataclasses.dataclass(frozen=True)
class Text:
    text: str


@dataclasses.dataclass(frozen=True)
class Finished:
    reason: str  # "stop" | "length"
    n_prompt: int
    n_cached: int
    n_completion: int


@dataclasses.dataclass(frozen=True)
class Failed:
    error: ApiError


# --- parsing ------------------------------------------------------------------------------------

def _field(body: dict, name: str, kind, default=None, check=None, what: str = ""):
    """body[name], None/absent -> default; of `kind` (bools are not numbers) and passing `check`."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join({int: "an integer", float: "a number", str: "a string",
                             bool: "a boolean", list: "an array", dict: "an object"}[k]
                            for k in kinds if not (k is int and float in kinds))
        raise ApiError(400, f"'{name}' must be {names}, got {type(value).__name__}", name,
                       "invalid_type")
    if check is not None and not check(value):
        raise ApiError(400, f"'{name}' must be {what}, got {value!r}", name, "invalid_value")
    return value


def _utf8(text: str, where: str) -> str:
    """`text`, unless it holds what UTF-8 cannot encode: JSON's "\\ud800" escapes decode to lone
    surrogates, which the tokenizer refused with a TypeError (a 500)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"'{where}' is not valid Unicode (a lone surrogate at character "
                            f"{e.start})", where, "invalid_value") from None
    return text


def _parts(content: list, where: str, images: list[str]) -> str | list[dict]:
    """Content parts: text, joined into one string; with images (OpenAI `image_url` parts holding
    data: URIs, appended to `images`), the parts as model/multimodal.py renders them."""
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": _utf8(part["text"], f"{where}.content")})
            continue
        url = part.get("image_url") if kind == "image_url" else None
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise ApiError(400, f"'{where}.content' parts must be text parts ({{\"type\": \"text\", "
                                f"\"text\": ...}}) or image_url parts", f"{where}.content")
        if not url.startswith("data:"):
            raise ApiError(400, f"'{where}.content' images must be data: URIs (this server fetches "
                                f"nothing)", f"{where}.content")
        images.append(url)
        parts.append({"type": "image"})
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _messages(body: dict, images: list[str]) -> list[dict]:
    messages = _field(body, "messages", list)
    if not messages:
        raise ApiError(400, "'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"'{where}' must be an object with a string 'role'", where)
        if m["role"] not in ("system", "developer", "user", "assistant"):
            raise ApiError(400, f"'{where}.role' must be system, developer, user or assistant, "
                                f"got {m['role']!r}", f"{where}.role")
        calls = next((k for k in ("tool_calls", "function_call") if m.get(k)), None)
        if calls:  # dropped, the model would see a history the client did not send
            raise ApiError(400, f"'{where}.{calls}': tool calls are not supported by this server",
                           f"{where}.{calls}", "unsupported_parameter")
        content = m.get("content")
        if isinstance(content, list):
            content = _parts(content, where, images)
        if content is None and m["role"] == "assistant":
            content = ""
        if isinstance(content, str):
            _utf8(content, f"{where}.content")
        if not isinstance(content, (str, list)):
            raise ApiError(400, f"'{where}.content' must be a string or content parts",
                           f"{where}.content")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": content})
    return out


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return _utf8(prompt, "prompt")
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        return prompt
    raise ApiError(400, "'prompt' must be a string or an array of token ids (one prompt: n = 1)",
                   "prompt")


def parse(body, is_chat: bool) -> Job:
    """A request body (decoded JSON) -> a Job, or ApiError(400)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, neutral in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(n) and value == n for n in neutral):
            raise ApiError(400, f"'{name}' is not supported by this server (got {value!r})",
                           name, "unsupported_parameter")
    _field(body, "model", str)
    n = _field(body, "n", int, 1)
    if n != 1:
        raise ApiError(400, f"only n = 1 is supported, got {n}", "n", "unsupported_value")
    images: list[str] = []
    prompt = _messages(body, images) if is_chat else _prompt(body)
    max_tokens = _field(body, "max_completion_tokens", int, None, lambda v: v >= 1, ">= 1")
    older = _field(body, "max_tokens", int, max_tokens, lambda v: v >= 1, ">= 1")
    if max_tokens is not None and older != max_tokens:  # which one? (vLLM and this differed)
        raise ApiError(400, f"'max_tokens' ({older}) and 'max_completion_tokens' ({max_tokens}) "
                            f"differ: give one", "max_completion_tokens", "invalid_value")
    max_tokens = older
    # llama.cpp's name for it (-1: no limit but the context), which its clients send
    n_predict = _field(body, "n_predict", int, -1, lambda v: v >= -1 and v != 0, ">= 1 or -1")
    if n_predict != -1:
        if max_tokens is not None and max_tokens != n_predict:
            raise ApiError(400, f"'n_predict' ({n_predict}) and 'max_tokens' ({max_tokens}) "
                                f"differ: give one", "n_predict", "invalid_value")
        max_tokens = n_predict
    temperature = _field(body, "temperature", (int, float), None, lambda v: 0 <= v <= 2,
                         "between 0 and 2")
    top_p = _field(body, "top_p", (int, float), None, lambda v: 0 < v <= 1, "in (0, 1]")
    top_k = _field(body, "top_k", int, None, lambda v: v >= 0, ">= 0 (0: all)")
    seed = _field(body, "seed", int, None, lambda v: -MAX_SEED <= v <= MAX_SEED, "a 64-bit integer")
    stop = _field(body, "stop", (str, list), ())
    stop = (stop,) if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"'stop' must be a string or at most {MAX_STOP_STRINGS} non-empty "
                            f"strings", "stop")
    for s in stop:
        _utf8(s, "stop")
        if len(s) > MAX_STOP_CHARS:
            raise ApiError(400, f"'stop' strings must be at most {MAX_STOP_CHARS} characters, "
                                f"got one of {len(s)}", "stop", "invalid_value")
    stream = _field(body, "stream", bool, False)
    options = _field(body, "stream_options", dict, {})
    include_usage = _field(options, "include_usage", bool, False)
    ignore_eos = _field(body, "ignore_eos", bool, False)
    template_kwargs = _template_kwargs(body, is_chat)
    return Job(is_chat=is_chat, prompt=prompt, max_tokens=max_tokens,
               temperature=None if temperature is None else float(temperature),
               top_p=None if top_p is None else float(top_p), top_k=top_k,
               seed=secrets.randbits(63) if seed in (None, RANDOM_SEED) else abs(seed),
               stop=tuple(stop),
               stream=stream, include_usage=include_usage, ignore_eos=ignore_eos,
               images=tuple(images), template_kwargs=template_kwargs)


def _template_kwargs(body: dict, is_chat: bool) -> dict:
    """vLLM's (and llama.cpp's) chat_template_kwargs: variables the model's chat template reads
    beside the messages (Qwen3's enable_thinking), chats only; none may be one the server sets
    (model/tokenizer.py TEMPLATE_NAMES)."""
    from fermijit.model.tokenizer import TEMPLATE_NAMES

    variables = _field(body, "chat_template_kwargs", dict, {})
    if variables and not is_chat:
        raise ApiError(400, "'chat_template_kwargs' applies to chat completions only",
                       "chat_template_kwargs", "unsupported_parameter")
    for name in variables:
        if not name.isidentifier() or name in TEMPLATE_NAMES:
            raise ApiError(400, f"'chat_template_kwargs' may not set {name!r} (a template "
                                f"variable name, not one the server sets)",
                           "chat_template_kwargs", "invalid_value")
    return variables


# --- responses ----------------------------------------------------------------------------------

def new_id(is_chat: bool) -> str:
    return ("chatcmpl-" if is_chat else "cmpl-") + secrets.token_hex(12)


def usage(done: Finished) -> dict:
    return {"prompt_tokens": done.n_prompt, "completion_tokens": done.n_completion,
            "total_tokens": done.n_prompt + done.n_completion,
            "prompt_tokens_details": {"cached_tokens": done.n_cached}}


def _choice(is_chat: bool, text: str | None, finish_reason: str | None, *, is_delta: bool,
            is_first: bool = False) -> dict:
    if not is_chat:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    if not is_delta:
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": finish_reason}
    delta = {} if text is None else {"content": text}
    if is_first:
        delta["role"] = "assistant"
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def response(is_chat: bool, rid: str, model: str, text: str, done: Finished) -> dict:
    return {"id": rid, "object": "chat.completion" if is_chat else "text_completion",
            "created": int(time.time()), "model": model,
            "choices": [_choice(is_chat, text, done.reason, is_delta=False)],
            "usage": usage(done)}


def chunk(is_chat: bool, rid: str, model: str, created: int, text: str | None,
          finish_reason: str | None = None, is_first: bool = False, usage_: dict | None = None,
          has_choice: bool = True) -> dict:
    body = {"id": rid, "object": "chat.completion.chunk" if is_chat else "text_completion",
            "created": created, "model": model,
            "choices": [_choice(is_chat, text, finish_reason, is_delta=True, is_first=is_first)]
            if has_choice else []}
    if usage_ is not None:
        body["usage"] = usage_
    return body
