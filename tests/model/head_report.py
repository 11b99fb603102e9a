"""What the LM head's format costs in held-out perplexity (issue 29 item 1: a smaller head is a
lever, its cost measured and reported): the embedded default model on its held-out text
(`python -m training.corpus build/default_corpus` writes heldout.txt), windows of `--ctx`.

The model's own forward runs once (W4A8, as `eval`); the final normed hidden state of every
position is kept, and each head format's logits are computed from it in float64 with that
format's dequantised weights: Q8_0 (the head as stored), Q6_K and Q4_0 requantised from it (so
every row carries Q8_0's error as well: the stored head stands in for the checkpoint's). The
default model's hidden size, 384, is not whole 256-blocks, which Q6_K needs: its rows are padded
with zeros to 512 for the quantiser (a zero half of a super-block leaves the other half's
16-value scales as they are) and the padding dropped. The engine's own perplexity (its W4A8 head
product) is printed beside, as a check on the float64 figures.

    python -m tests.model.head_report --text build/default_corpus/heldout.txt [--ctx 512]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from fermijit.evaluate import score, token_nll
from fermijit.model.forward import load_model
from fermijit.model.tokenizer import Tokenizer
from fermijit.ops import kquant, kquant_quantize, quant, rmsnorm


def heads(stored) -> dict[str, np.ndarray]:
    """Each format's dequantised head [V, H] fp32, from the stored Q8_0 one."""
    w = quant.dequantize_q8_0(stored.qs, stored.d)
    V, H = w.shape
    pad = -H % kquant.Q6_K.block_values
    padded = np.concatenate([w, np.zeros((V, pad), np.float32)], axis=1)
    q6 = kquant.dequantize(kquant.Q6_K, kquant_quantize.quantize_cpu(kquant.Q6_K, padded))
    return {"q8_0": w, "q6_k": q6.reshape(V, H + pad)[:, :H],
            "q4_0": quant.dequantize_q4_0(*quant.quantize_q4_0(w))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, default=Path("fermijit/default_model"))
    p.add_argument("--text", type=Path, required=True)
    p.add_argument("--ctx", type=int, default=512)
    a = p.parse_args(argv)
    cfg, model = load_model(a.model)
    tokens = Tokenizer(a.model, cfg.text_config.eos_token_id, model.vocab_size).encode(
        a.text.read_text(encoding="utf-8"))
    hidden = []
    logits = model.logits

    def keeping(x, out):
        hidden.append(rmsnorm.cpu(x, model.norm, model.eps).copy())
        return logits(x, out)

    model.logits = keeping
    engine = score(model, tokens, a.ctx)
    xn = np.concatenate(hidden).astype(np.float64)       # the scored positions' rows, in order
    targets = np.concatenate([tokens[w0 + 1:min(w0 + a.ctx, tokens.size - 1) + 1]
                              for w0 in range(0, tokens.size - 1, a.ctx)])
    assert xn.shape[0] == targets.size == engine.n_scored
    stored = heads(model.lm_head)
    out = {"model": str(a.model), "text": str(a.text), "ctx": a.ctx,
           "n_scored": engine.n_scored, "engine_q8_0_perplexity": engine.perplexity}
    base = None
    for kind, w in stored.items():
        nll = sum(float(token_nll(xn[i:i + 4096] @ w.T.astype(np.float64),
                                  targets[i:i + 4096]).sum())
                  for i in range(0, targets.size, 4096))
        ppl = float(np.exp(nll / targets.size))
        base = base or ppl
        err = float(np.sqrt(np.mean((w - stored["q8_0"]) ** 2) / np.mean(stored["q8_0"] ** 2)))
        out[kind] = {"perplexity": ppl, "of_q8_0": ppl / base - 1,
                     "weight_rms_error_vs_q8_0": err}
        print(f"{kind}: perplexity {ppl:.4f} ({100 * (ppl / base - 1):+.3f} % of q8_0's), "
              f"weights' RMS difference from the stored head {100 * err:.2f} %", flush=True)
    print(f"engine (W4A8, the stored q8_0 head): perplexity {engine.perplexity:.4f} over "
          f"{engine.n_scored} predictions, windows of {a.ctx}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
