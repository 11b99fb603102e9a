"""transformers as the oracle (MODEL.md §8) on the tiny models, live and stored.

`live` runs transformers (fp32, eager attention) where it is importable; its outputs are also
stored in golden/, one file per tiny model, so the default test run needs no torch. Each golden
file names the model it was made from (a fingerprint of config and weights) and the prompt.
Regenerate them with
    .venv/bin/python -m tests.model.oracle
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from tests.model import tiny
from tests.numerics import assert_close

GOLDEN_FORMAT = 2  # 2: eager experts; the W4A8 oracle's outputs too, for models on the grid
REGENERATE = ".venv/bin/python -m tests.model.oracle"
GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN = {tiny.UNIT.name: GOLDEN_DIR / "tiny_oracle.npz",
          tiny.HF_INIT.name: GOLDEN_DIR / "tiny_hf_init_oracle.npz",
          tiny.SENSITIVE.name: GOLDEN_DIR / "tiny_sensitive_oracle.npz"}
# Issue 31 item 6: LONG_CONTEXT over a prompt of 4096 tokens, transformers' logits at every 512th
# position (and the last) and its greedy continuation, in a file of its own: regenerate it with
#     .venv/bin/python -m tests.model.oracle --long-context
GOLDEN_LONG_CONTEXT = GOLDEN_DIR / "tiny_long_context_oracle.npz"
LONG_CONTEXT_PROMPT = np.random.default_rng(4096).integers(0, 300, 4096)
LONG_CONTEXT_ROWS = np.append(np.arange(0, 4096, 512), 4095)
MODELS = (tiny.UNIT, tiny.HF_INIT, tiny.SENSITIVE)
PROMPT = np.array([5, 17, 200, 33, 9, 100, 250, 7, 1, 300, 42, 64, 64, 3, 128, 77])
N_DECODE = 32
# Past the 512-token prefill block, twice (tests/model/test_long_prompt.py): a seeded prompt of
# 1100 tokens, and the rows of its logits stored (around each block boundary, and the last).
LONG_PROMPT = np.random.default_rng(1100).integers(0, 300, 1100)
LONG_ROWS = np.array([0, 1, 255, 510, 511, 512, 513, 700, 1022, 1023, 1024, 1025, 1099])


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


def golden(model: tiny.Model, w4a8: bool = False) -> Outputs:
    """The stored outputs of transformers (`w4a8`: of the W4A8 oracle, for models on the grid)."""
    g = np.load(GOLDEN[model.name])
    assert int(g["format_version"]) == GOLDEN_FORMAT, f"old golden format; run {REGENERATE}"
    assert str(g["fingerprint"]) == fingerprint(model), \
        f"tests/model/tiny.py changed the {model.name} model; run {REGENERATE}"
    np.testing.assert_array_equal(g["prompt"], PROMPT, f"the prompt changed; run {REGENERATE}")
    p = "w4a8_" if w4a8 else ""
    return Outputs(g[p + "prompt_logits"], g[p + "tokens"], g[p + "decode_logits"])


def golden_long(model: tiny.Model) -> np.ndarray:
    """transformers' logits of LONG_PROMPT at LONG_ROWS [len(LONG_ROWS), V], stored."""
    golden(model)                                         # the file is this model's, current
    g = np.load(GOLDEN[model.name])
    np.testing.assert_array_equal(g["long_prompt"], LONG_PROMPT, f"run {REGENERATE}")
    np.testing.assert_array_equal(g["long_rows"], LONG_ROWS, f"run {REGENERATE}")
    return g["long_logits"]


def live_long(directory: Path) -> np.ndarray:
    import torch

    with torch.no_grad():
        logits = hf_model(directory)(input_ids=torch.tensor(LONG_PROMPT[None])).logits[0]
    return logits.numpy()[LONG_ROWS]


def hf_model(directory: Path):
    import torch
    import transformers

    # Eager experts: the per-expert loop calls torch.nn.functional.linear, which
    # w4a8_activations hooks (the default grouped kernel does not).
    return transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager",
        experts_implementation="eager")


# The checkpoint names of the matrices fermijit quantises (model/convert.py: Q4_0_FIELDS and the
# LM head): their products see 8-bit activations.
QUANTISED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
             "in_proj_qkv.weight", "in_proj_z.weight", "out_proj.weight", "experts.gate_up_proj",
             "experts.down_proj", "gate_proj.weight", "up_proj.weight", "down_proj.weight",
             "lm_head.weight")


@contextlib.contextmanager
def w4a8_activations(model):
    """transformers as the W4A8 oracle: every product with a quantised matrix sees its input
    quantised per 32-block (scale max|x|/127, round half away from zero), written here in torch
    from the spec, so the oracle shares no code with fermijit. On a model whose weights are on
    the quantisation grid (tiny.Model.on_grid) this is the 4-bit engine's exact arithmetic."""
    import torch

    storages = {p.untyped_storage().data_ptr() for name, p in model.named_parameters()
                if name.endswith(QUANTISED)}
    linear = torch.nn.functional.linear

    def quantised_linear(x, weight, bias=None):
        if weight.untyped_storage().data_ptr() in storages:
            xb = x.reshape(*x.shape[:-1], -1, 32)
            d = xb.abs().amax(dim=-1, keepdim=True) / 127
            inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
            v = xb * inv
            x = (torch.sign(v) * torch.floor(v.abs() + 0.5) * d).reshape(x.shape)
        return linear(x, weight, bias)

    torch.nn.functional.linear = quantised_linear
    try:
        yield model
    finally:
        torch.nn.functional.linear = linear


def live(directory: Path, w4a8: bool = False) -> Outputs:
    """transformers' prompt logits, greedy tokens and their logits (`w4a8`: as the W4A8 oracle);
    needs torch."""
    model = hf_model(directory)
    with (w4a8_activations(model) if w4a8 else contextlib.nullcontext()):
        return _greedy(model)


def _greedy(model) -> Outputs:
    return greedy_logits(model, PROMPT, N_DECODE)


def greedy_logits(model, prompt, n_decode: int) -> Outputs:
    """transformers' logits over `prompt`, its greedy continuation of `n_decode` tokens (with
    the cache) and the logits after each of them."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor(np.asarray(prompt)[None]), use_cache=True)
        prompt_logits = out.logits[0].numpy()
        tokens, decode_logits = [], []
        token = int(prompt_logits[-1].argmax())
        for _ in range(n_decode):
            tokens.append(token)
            out = model(input_ids=torch.tensor([[token]]), cache=out.cache, use_cache=True)
            decode_logits.append(out.logits[0, -1].numpy())
            token = int(decode_logits[-1].argmax())
    return Outputs(prompt_logits, np.array(tokens), np.stack(decode_logits))


def golden_long_context() -> Outputs:
    """transformers over LONG_CONTEXT_PROMPT on tiny.LONG_CONTEXT: the logits at
    LONG_CONTEXT_ROWS (prompt_logits), the greedy tokens after it and their logits."""
    g = np.load(GOLDEN_LONG_CONTEXT)
    assert int(g["format_version"]) == GOLDEN_FORMAT, "old golden format; regenerate it"
    assert str(g["fingerprint"]) == fingerprint(tiny.LONG_CONTEXT), \
        "tests/model/tiny.py changed the long-context model: regenerate its golden file"
    np.testing.assert_array_equal(g["prompt"], LONG_CONTEXT_PROMPT, "the prompt changed")
    np.testing.assert_array_equal(g["rows"], LONG_CONTEXT_ROWS, "the rows changed")
    return Outputs(g["prompt_logits"], g["tokens"], g["decode_logits"])


def write_golden_long_context(directory: Path) -> None:
    import torch
    import transformers

    checkpoint = tiny.write_checkpoint(directory, model=tiny.LONG_CONTEXT)
    out = greedy_logits(hf_model(checkpoint), LONG_CONTEXT_PROMPT, N_DECODE)
    np.savez_compressed(
        GOLDEN_LONG_CONTEXT, format_version=GOLDEN_FORMAT,
        command=REGENERATE + " --long-context", fingerprint=fingerprint(tiny.LONG_CONTEXT),
        model=tiny.LONG_CONTEXT.name,
        versions=f"transformers {transformers.__version__}, torch {torch.__version__}",
        prompt=LONG_CONTEXT_PROMPT, rows=LONG_CONTEXT_ROWS,
        prompt_logits=out.prompt_logits[LONG_CONTEXT_ROWS].astype(np.float32),
        tokens=out.tokens, decode_logits=out.decode_logits.astype(np.float32))


def has_transformers() -> bool:
    from tests import hf
    return hf.available()


def assert_rel(name, expected, actual, rel):
    """max|diff| <= rel · max|expected|: issue 3's measure, through the one comparison."""
    assert_close(name, expected, actual, atol=rel * float(np.abs(expected).max()), rtol=0)


def assert_rel_but_flips(name, expected, actual, rel, flip_rel, max_flips: int):
    """assert_rel at `rel` for every position (row) but at most `max_flips`, and at `flip_rel`
    for all: for W4A8 against a spec that computes in another fp32 order (transformers, the GPU),
    where an activation on either side of an 8-bit rounding boundary moves its position's logits,
    and through the state later ones', by up to ~5e-3 (SENSITIVE). `max_flips` is what the
    caller measured (issue 33: not a share of the positions). Against the float64 reference,
    tests/model/flips.py's `follow` explains each flip instead of counting it."""
    e, a = np.asarray(expected, np.float64), np.asarray(actual, np.float64)
    assert e.shape == a.shape, f"{name}: shape {a.shape}, expected {e.shape}"
    per_row = np.abs(a - e).reshape(len(e), -1).max(axis=1) / np.abs(e).max()
    off = np.flatnonzero(~(per_row <= rel))                       # NaN is off
    print(f"{name}: {off.size} of {len(e)} positions off by more than {rel:g} (at most "
          f"{max_flips}): {[(int(i), float(f'{per_row[i]:.3g}')) for i in off]}")
    assert off.size <= max_flips, (
        f"{name}: {off.size}/{len(e)} positions off by more than {rel:g} of the largest logit, "
        f"where {max_flips} were measured: {[(int(i), float(f'{per_row[i]:.3g}')) for i in off]}")
    assert_rel(name, e, a, flip_rel)


def rel_error(expected, actual) -> float:
    return float(np.abs(np.asarray(actual, np.float64) - expected).max() / np.abs(expected).max())


def write_golden(model: tiny.Model, directory: Path) -> None:
    import torch
    import transformers

    checkpoint = tiny.write_checkpoint(directory, model=model)
    runs = {"": live(checkpoint)}
    if model.on_grid:
        runs["w4a8_"] = live(checkpoint, w4a8=True)
    arrays = {p + k: (v.astype(np.float32) if k.endswith("logits") else v)
              for p, out in runs.items() for k, v in dataclasses.asdict(out).items()}
    if model.text_config["max_position_embeddings"] >= LONG_PROMPT.size:
        arrays.update(long_prompt=LONG_PROMPT, long_rows=LONG_ROWS,
                      long_logits=live_long(checkpoint).astype(np.float32))
    GOLDEN_DIR.mkdir(exist_ok=True)
    np.savez_compressed(
        GOLDEN[model.name], format_version=GOLDEN_FORMAT, command=REGENERATE,
        fingerprint=fingerprint(model), model=model.name,
        versions=f"transformers {transformers.__version__}, torch {torch.__version__}",
        prompt=PROMPT, **arrays)


if __name__ == "__main__":
    import sys
    import tempfile

    if "--long-context" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            write_golden_long_context(Path(tmp) / tiny.LONG_CONTEXT.name)
        print(f"wrote {GOLDEN_LONG_CONTEXT}")
        sys.exit()
    for m in MODELS:
        with tempfile.TemporaryDirectory() as tmp:
            write_golden(m, Path(tmp) / m.name)
        print(f"wrote {GOLDEN[m.name]}")
