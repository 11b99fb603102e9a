"""`python -m fermijit eval`: how well a model predicts a text, by teacher forcing.

The text is tokenised as `generate` tokenises a prompt (`<|endoftext|>` first where the tokenizer
adds it), then cut into windows of `context` tokens, each scored from a fresh state: prefill the
window with the logits of every position, and the negative log-likelihood of each next token is
    nll_t = logsumexp(logits_t) - logits_t[token_{t+1}]        (nats, float64)
Every token but the first is predicted once; its window's earlier tokens are its only context, as
in training/train.py `evaluate` (non-overlapping windows). Perplexity = exp(mean nll).

The forward is the one `generate` runs (model/forward.py prefill): W4A8 for a fermijit model, fp32
for an HF checkpoint. A window is prefilled in pieces of at most PREFILL_BLOCK tokens on one state,
so the logits held at once stay [PREFILL_BLOCK, V] (1 GB for the real model's 248k vocabulary at
a 2048 window, were they held whole).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from fermijit import FermijitError

# The default model's training window (training/train.py PRESETS["default"].context): its
# held-out figure in train_log.json is measured on windows of this length.
DEFAULT_CONTEXT = 512
PROGRESS_DELAY_S = 1.0  # the progress bar appears only if scoring takes longer


@dataclasses.dataclass(frozen=True)
class Score:
    n_tokens: int     # tokens of the text, the leading <|endoftext|> included
    n_windows: int
    context: int      # tokens per window (the last may be shorter)
    nll_sum: float    # nats, over the n_tokens - 1 predictions
    elapsed_s: float  # the forwards and the NLL, not loading or compiling

    @property
    def n_scored(self) -> int:
        return self.n_tokens - 1

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.n_scored

    @property
    def perplexity(self) -> float:
        return float(np.exp(self.mean_nll))

    @property
    def tok_per_s(self) -> float:
        return self.n_scored / self.elapsed_s if self.elapsed_s else float("nan")

    def as_dict(self) -> dict:
        return {"n_tokens": self.n_tokens, "n_scored": self.n_scored,
                "n_windows": self.n_windows, "context": self.context, "mean_nll": self.mean_nll,
                "perplexity": self.perplexity, "elapsed_s": self.elapsed_s,
                "tok_per_s": self.tok_per_s}


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """float64 [T]: -log softmax(logits [T, V])[t, targets[t]]."""
    z = logits.astype(np.float64)
    top = z.max(axis=1)
    log_sum = top + np.log(np.exp(z - top[:, None]).sum(axis=1))
    return log_sum - z[np.arange(targets.size), targets]


def score(model, tokens: np.ndarray, context: int, on_scored=lambda n: None,
          prefiller=None) -> Score:
    """Teacher-forced NLL of `tokens` [N] (N >= 2) in windows of `context`; `on_scored(n)` after
    each piece of n predictions. `prefiller` (fermijit/prefill/hybrid.py) runs the forwards
    (default: the CPU's)."""
    from fermijit.model.forward import PREFILL_BLOCK
    from fermijit.prefill.hybrid import CpuPrefiller

    prefiller = prefiller or CpuPrefiller(model)
    tokens = np.asarray(tokens, dtype=np.int32)
    if tokens.ndim != 1 or tokens.size < 2:
        raise FermijitError(f"scoring needs at least 2 tokens, got {tokens.size}")
    inputs, targets = tokens[:-1], tokens[1:]
    nll_sum, n_windows = 0.0, 0
    start = time.perf_counter()
    for w0 in range(0, inputs.size, context):
        w1 = min(w0 + context, inputs.size)
        state = model.new_state(w1 - w0)
        for b0 in range(w0, w1, PREFILL_BLOCK):
            b1 = min(b0 + PREFILL_BLOCK, w1)
            logits = prefiller.prefill(inputs[b0:b1], state, all_logits=True)  # [b1 - b0, V]
            nll_sum += float(token_nll(logits, targets[b0:b1]).sum())
            on_scored(b1 - b0)
        n_windows += 1
    return Score(int(tokens.size), n_windows, context, nll_sum, time.perf_counter() - start)


def read_text(path: Path) -> str:
    from fermijit.model.files import read_text as read

    text = read(path, str(path))
    if not text.strip():
        raise FermijitError(f"{path}: the text is empty")
    return text


def run(model_dir: Path, text_path: Path, context: int | None, as_json: bool,
        out=None, err=None, prefill: str = "auto", gpu_mem: str | None = None,
        pin_budget: str | None = None, verbose: bool = False, kv=None) -> Score:
    """`eval` for the CLI: the figures to `out` (a table, or JSON), progress to `err`; `prefill`,
    `gpu_mem`, `pin_budget`, `verbose` choose the prefiller (fermijit/prefill/hybrid.py); `kv` the
    KV cache's kind (default Q8_0)."""
    from tqdm import tqdm

    from fermijit.engine import warm_up
    from fermijit.model import files
    from fermijit.model.forward import PREFILL_BLOCK, load_model
    from fermijit.model.tokenizer import Tokenizer
    from fermijit.prefill import hybrid

    out = out or sys.stdout
    err = err or sys.stderr
    hybrid.parse_bytes(gpu_mem), hybrid.parse_bytes(pin_budget)  # a bad size fails before loading
    text = read_text(text_path)
    from fermijit.model.state import DEFAULT_KV

    cfg, model = load_model(model_dir, show_progress=True, kv=kv or DEFAULT_KV)
    tokens = Tokenizer(model_dir, cfg.text_config.eos_token_id, model.vocab_size).encode(text)
    if tokens.size < 2:
        raise FermijitError(f"{text_path}: {tokens.size} token, nothing to predict")
    if context is None:
        context = min(DEFAULT_CONTEXT, model.max_context)
    elif not 1 <= context <= model.max_context:
        raise FermijitError(f"--ctx must be between 1 and {model.max_context} "
                            f"(max_position_embeddings), got {context}")
    kind = "4-bit fermijit, W4A8" if model.is_quantized else "fp32 HF checkpoint, unquantised"
    print(f"loaded {model_dir} ({kind}); {text_path}: {tokens.size} tokens", file=err, flush=True)
    n_warm_up = min(context, tokens.size - 1, PREFILL_BLOCK)  # the shapes scoring will run
    print(f"kernels ready in {warm_up(model, tokens, n_warm_up):.2f} s", file=err, flush=True)
    prefiller = hybrid.make(model, prefill, gpu_mem, pin_budget, verbose, err)
    prefiller.prepare()
    with tqdm(total=tokens.size - 1, desc="eval", unit="tok", file=err,
              delay=PROGRESS_DELAY_S) as bar:
        result = score(model, tokens, context, bar.update, prefiller)
    files.check_mappings()  # the weights rewritten in place meanwhile: the score is suspect
    if as_json:
        print(json.dumps({"model": str(model_dir), "text": str(text_path),
                          "is_quantized": model.is_quantized, "kv_cache": model.kv_kind.value,
                          **result.as_dict()}), file=out)
    else:
        for key, value in (("tokens", f"{result.n_tokens} ({result.n_scored} predicted, "
                                      f"{result.n_windows} windows of {context})"),
                           ("mean NLL", f"{result.mean_nll:.4f} nats/token"),
                           ("perplexity", f"{result.perplexity:.3f}"),
                           ("KV cache", model.kv_kind.value),
                           ("tok/s", f"{result.tok_per_s:.1f}")):
            print(f"{key + ':':<12} {value}", file=out)
    return result
