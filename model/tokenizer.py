"""Text <-> tokens: `tokenizer.json` through the `tokenizers` library, the chat template of
`tokenizer_config.json` rendered with jinja2, the stop ids of `generation_config.json`, and an
incremental detokeniser for streaming.

Streaming decodes a growing window of tokens and emits only text that is final: a byte-level BPE
token can end inside a multi-byte UTF-8 character, which decodes to U+FFFD until the token that
completes it arrives (the scheme of HF text-generation-inference's `decode_token`).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import numpy as np

from fermijit import FermijitError

INCOMPLETE = "\ufffd"  # what a cut multi-byte character decodes to


def _read_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FermijitError(f"{path}: not a readable JSON file ({e})") from None
    if not isinstance(raw, dict):
        raise FermijitError(f"{path}: expected a JSON object")
    return raw


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value, where: str) -> tuple[int, ...]:
    ids = value if isinstance(value, (list, tuple)) else [] if value is None else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise FermijitError(f"{where}: eos_token_id must be an int or a list of ints")
    return tuple(ids)


class Tokenizer:
    """A model directory's tokenizer, chat template and stop ids."""

    def __init__(self, directory: str | Path, config_eos: int | tuple[int, ...] | None = None):
        from tokenizers import Tokenizer as HfTokenizer

        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FermijitError(f"{directory}: no tokenizer.json")
        try:
            self._tok = HfTokenizer.from_file(str(path))
        except Exception as e:  # the library raises its own untyped exceptions
            raise FermijitError(f"{path}: not a readable tokenizer ({e})") from None
        cfg_path = directory / "tokenizer_config.json"
        cfg = _read_json(cfg_path) if cfg_path.is_file() else {}
        self.chat_template = self._find_template(directory, cfg)
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        gen_path = directory / "generation_config.json"
        gen = _read_json(gen_path) if gen_path.is_file() else {}
        self.generation_config = gen
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
        if template is None and (directory / "chat_template.jinja").is_file():
            template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
        return template if isinstance(template, str) else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
        """int32 [T]. Special tokens written in `text` (e.g. from a chat template) are matched."""
        return np.array(self._tok.encode(text, add_special_tokens=add_special_tokens).ids,
                        dtype=np.int32)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template applied to `messages` ([{"role", "content"}]), as HF's
        apply_chat_template renders it (sandboxed jinja2, trim_blocks, lstrip_blocks)."""
        if self.chat_template is None:
            raise FermijitError("--chat: the model has no chat template (tokenizer_config.json "
                                "chat_template or chat_template.jinja)")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.exceptions.TemplateError as e:
            raise FermijitError(f"chat template: {e}") from None

    def stream(self) -> "StreamDecoder":
        return StreamDecoder(self)


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
