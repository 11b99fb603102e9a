"""transformers as the oracle (MODEL.md §8) on the tiny models, live and stored.

`live` runs transformers (fp32, eager attention) where it is importable; its outputs are also
stored in golden/, one file per tiny model, so the default test run needs no torch. Each golden
file names the model it was made from (a fingerprint of config and weights) and the prompt.
Regenerate them with
    .venv/bin/python -m tests.model.oracle
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from tests.model import tiny
from tests.numerics import assert_close

GOLDEN_FORMAT = 1
REGENERATE = ".venv/bin/python -m tests.model.oracle"
GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN = {tiny.UNIT.name: GOLDEN_DIR / "tiny_oracle.npz",
          tiny.HF_INIT.name: GOLDEN_DIR / "tiny_hf_init_oracle.npz"}
MODELS = (tiny.UNIT, tiny.HF_INIT)
PROMPT = np.array([5, 17, 200, 33, 9, 100, 250, 7, 1, 300, 42, 64, 64, 3, 128, 77])
N_DECODE = 32


@dataclasses.dataclass(frozen=True)
class Outputs:
    prompt_logits: np.ndarray  # [len(PROMPT), V]
    tokens: np.ndarray         # [N_DECODE] greedy: the argmax after the prompt, then each step's
    decode_logits: np.ndarray  # [N_DECODE, V] the logits after each of `tokens`


def fingerprint(model: tiny.Model) -> str:
    """A tiny model's identity: config and every weight's bytes."""
    h = hashlib.sha256(json.dumps(tiny.config_dict(model), sort_keys=True).encode())
    for name, a in sorted(tiny.random_weights(model=model).items()):
        h.update(name.encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def golden(model: tiny.Model) -> Outputs:
    g = np.load(GOLDEN[model.name])
    assert int(g["format_version"]) == GOLDEN_FORMAT, f"old golden format; run {REGENERATE}"
    assert str(g["fingerprint"]) == fingerprint(model), \
        f"tests/model/tiny.py changed the {model.name} model; run {REGENERATE}"
    np.testing.assert_array_equal(g["prompt"], PROMPT, f"the prompt changed; run {REGENERATE}")
    return Outputs(g["prompt_logits"], g["tokens"], g["decode_logits"])


def live(directory: Path) -> Outputs:
    """transformers' prompt logits, greedy tokens and their logits; needs torch."""
    import torch
    import transformers

    model = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        out = model(input_ids=torch.tensor(PROMPT[None]), use_cache=True)
        prompt_logits = out.logits[0].numpy()
        tokens, decode_logits = [], []
        token = int(prompt_logits[-1].argmax())
        for _ in range(N_DECODE):
            tokens.append(token)
            out = model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
            decode_logits.append(out.logits[0, -1].numpy())
            token = int(decode_logits[-1].argmax())
    return Outputs(prompt_logits, np.array(tokens), np.stack(decode_logits))


def has_transformers() -> bool:
    from tests import hf
    return hf.available()


def assert_rel(name, expected, actual, rel):
    """max|diff| <= rel · max|expected|: issue 3's measure, through the one comparison."""
    assert_close(name, expected, actual, atol=rel * float(np.abs(expected).max()), rtol=0)


def rel_error(expected, actual) -> float:
    return float(np.abs(np.asarray(actual, np.float64) - expected).max() / np.abs(expected).max())


def write_golden(model: tiny.Model, directory: Path) -> None:
    import torch
    import transformers

    out = live(tiny.write_checkpoint(directory, model=model))
    GOLDEN_DIR.mkdir(exist_ok=True)
    np.savez_compressed(
        GOLDEN[model.name], format_version=GOLDEN_FORMAT, command=REGENERATE,
        fingerprint=fingerprint(model), model=model.name,
        versions=f"transformers {transformers.__version__}, torch {torch.__version__}",
        prompt=PROMPT, prompt_logits=out.prompt_logits.astype(np.float32), tokens=out.tokens,
        decode_logits=out.decode_logits.astype(np.float32))


if __name__ == "__main__":
    import tempfile

    for m in MODELS:
        with tempfile.TemporaryDirectory() as tmp:
            write_golden(m, Path(tmp) / m.name)
        print(f"wrote {GOLDEN[m.name]}")
