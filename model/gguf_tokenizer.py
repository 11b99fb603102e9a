"""The tokenizer of a GGUF file (`tokenizer.ggml.*`) as the files model/tokenizer.py reads:
tokenizer.json (a `tokenizers` byte-level BPE), tokenizer_config.json (chat template, bos/eos)
and generation_config.json (stop ids, sampling defaults where the file has them).

llama.cpp keeps the vocabulary (`tokens`, `token_type`), the BPE `merges` and the name of the
pre-tokenizer (`pre`), not its regex: the regexes are llama.cpp's (src/llama-vocab.cpp), for the
names Qwen models use. Tokens of type CONTROL are special added tokens (matched whole in text,
skipped when decoding), USER_DEFINED ones plain added tokens; UNUSED ones (llama.cpp's [PAD<i>]
fillers up to the model's vocab size) stay in the vocabulary but no merge makes them.
"""

from __future__ import annotations

import json

import numpy as np

from fermijit import FermijitError

# tokenizer.ggml.pre -> the split regex of the HF tokenizer.json it came from.
SPLIT_REGEX = {
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
              r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "qwen35": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"
               r" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
CONTROL, USER_DEFINED = 3, 4  # gguf.TokenType
# general.sampling.* (llama.cpp's recommended-sampling keys) -> generation_config.json
SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_k": "top_k",
            "general.sampling.top_p": "top_p"}


def tokenizer_json(g) -> dict:
    """tokenizer.json, as a dict, from the metadata of GgufFile `g`."""
    model = g.value("tokenizer.ggml.model", None)
    if model != "gpt2":
        raise FermijitError(f"{g.path}: tokenizer.ggml.model {model!r} is not supported "
                            f"(fermijit reads byte-level BPE, 'gpt2')")
    pre = g.value("tokenizer.ggml.pre", "default")
    if pre not in SPLIT_REGEX:
        raise FermijitError(f"{g.path}: tokenizer.ggml.pre {pre!r} is not supported "
                            f"(supported: {', '.join(SPLIT_REGEX)})")
    tokens = g.value("tokenizer.ggml.tokens")
    types = g.value("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = g.value("tokenizer.ggml.merges", [])
    if len(types) != len(tokens) or any(not isinstance(m, str) or " " not in m for m in merges):
        raise FermijitError(f"{g.path}: malformed tokenizer metadata (token types or merges)")
    added = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": kind == CONTROL}
             for i, (tok, kind) in enumerate(zip(tokens, types)) if kind in (CONTROL, USER_DEFINED)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                  "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": SPLIT_REGEX[pre]}, "behavior": "Isolated",
             "invert": False}, byte_level]},
        "post_processor": _post_processor(g, tokens),
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {tok: i for i, tok in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in merges]},
    }


def _token(g, tokens: list[str], key: str) -> tuple[int, str] | None:
    i = g.value(f"tokenizer.ggml.{key}_token_id", None)
    if i is None:
        return None
    if not isinstance(i, int) or not 0 <= i < len(tokens):
        raise FermijitError(f"{g.path}: tokenizer.ggml.{key}_token_id {i!r} is not a token")
    return i, tokens[i]


def _post_processor(g, tokens: list[str]) -> dict | None:
    """bos (and eos) added around a text as tokenizer.ggml.add_bos_token/add_eos_token say."""
    ends = [(key, _token(g, tokens, key)) for key in ("bos", "eos")
            if g.value(f"tokenizer.ggml.add_{key}_token", False)]
    if not ends:
        return None
    for key, token in ends:
        if token is None:
            raise FermijitError(f"{g.path}: tokenizer.ggml.add_{key}_token without a {key} token")
    first = [{"SpecialToken": {"id": t[1], "type_id": 0}} for k, t in ends if k == "bos"]
    last = [{"SpecialToken": {"id": t[1], "type_id": 0}} for k, t in ends if k == "eos"]
    seq = [{"Sequence": {"id": "A", "type_id": 0}}]
    return {"type": "TemplateProcessing", "single": first + seq + last,
            "pair": first + seq + last + first + [{"Sequence": {"id": "B", "type_id": 1}}] + last,
            "special_tokens": {t[1]: {"id": t[1], "ids": [t[0]], "tokens": [t[1]]}
                               for _, t in ends}}


def tokenizer_files(g) -> dict[str, str]:
    """{file name: text} of tokenizer.json, tokenizer_config.json and generation_config.json."""
    tokenizer = tokenizer_json(g)
    tokens = g.value("tokenizer.ggml.tokens")
    bos, eos = _token(g, tokens, "bos"), _token(g, tokens, "eos")
    eot, pad = _token(g, tokens, "eot"), _token(g, tokens, "padding")
    template = g.value("tokenizer.chat_template", None)
    config = {"bos_token": bos and bos[1], "eos_token": eos and eos[1],
              "pad_token": pad and pad[1], **({"chat_template": template} if template else {})}
    stops = [t[0] for t in (eos, eot) if t is not None]
    generation = {"bos_token_id": bos and bos[0], "eos_token_id": sorted(set(stops)),
                  "pad_token_id": pad and pad[0]}
    for key, name in SAMPLING.items():
        value = g.value(key, None)
        if value is not None:  # float32 in the file: its shortest decimal, as config files say it
            generation[name] = float(str(np.float32(value))) if isinstance(value, float) else value
    if "temperature" in generation:
        generation["do_sample"] = generation["temperature"] > 0
    return {"tokenizer.json": json.dumps(tokenizer, ensure_ascii=False),
            "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
            "generation_config.json": json.dumps(generation, indent=2) + "\n"}
