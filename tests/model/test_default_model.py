"""The embedded default model end to end (issue 4): fermijit's W4A8 perplexity of a held-out
sample and its teacher-forced argmaxes over ten prompts' greedy continuations, against
transformers in fp32 on the unquantised weights (tests/model/default_oracle.py), whose figures are
stored in golden/default_model_oracle.json; where the HF checkpoint (build/default-hf, not
committed) and transformers are at hand, that oracle also runs live. Everywhere torch is, the
shipped 4-bit weights are exported dequantised (tests/model/export.py) and transformers runs on
them against fermijit's fp32 path (issue 12, item 3).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from fermijit.engine import DEFAULT_MODEL, generate
from fermijit.model.forward import load_model
from fermijit.model.state import KvKind
from fermijit.ops.sampling import Sampler
from tests.model import default_oracle as oracle, export
from tests.model.oracle import assert_rel

# Issue 4: W4A8 perplexity within 5% of the fp32 oracle's. Measured: 39.933 vs 39.686 (+0.62%).
W4A8_PPL_REL = 0.05
# fermijit's fp32 path vs transformers' fp32, same weights: summation order only. Measured 2e-8.
FP32_PPL_REL = 1e-5
# transformers now vs the stored run: another machine or torch build reorders fp32 sums.
GOLDEN_NLL_REL = 1e-5
# Item 4 (issue 12), over the ten prompts' 320 positions; bounds a little under the measured.
W4A8_TOP1_VS_ORACLE = 0.87    # measured 289/320 = 0.903
W4A8_TOP1_VS_FP32 = 0.95      # measured 313/320 = 0.978
W4A8_KL_VS_FP32 = 2e-3        # measured 1.12e-3 nats
# Item 3: fp32 path vs transformers on the dequantised weights (max|diff| / max|logit|).
# Measured: 1.07e-6 (prompt), 4.0e-7 (32 decode steps); the tiny models' bound.
FP32_VS_TRANSFORMERS = 2e-5

needs_hf = pytest.mark.skipif(not (oracle.HF_DIR / "config.json").is_file(),
                              reason=f"{oracle.HF_DIR} (the unquantised checkpoint) is not here")
needs_live = pytest.mark.skipif(not oracle.has_live_oracle(),
                                reason="the live oracle needs build/default-hf and transformers")


@pytest.fixture(scope="module")
def cli_eval():
    """`python -m fermijit eval` on the sample with no --model: (parsed JSON, stderr)."""
    r = subprocess.run([sys.executable, "-m", "fermijit", "eval", "--text", oracle.SAMPLE,
                        "--ctx", str(oracle.CONTEXT), "--json", "--threads", "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout), r.stderr


@pytest.fixture(scope="module")
def live_model():
    if not oracle.has_live_oracle():
        pytest.skip("the live oracle needs build/default-hf and transformers")
    import torch

    torch.set_num_threads(1)
    return oracle.load_hf()


def greedy(model, n_tokens: int) -> list[int]:
    sampler = Sampler(model.vocab_size, temperature=0, top_k=0, top_p=1, seed=0)
    tokens, _ = generate(model, oracle.tokenizer().encode(oracle.PROMPT), sampler, n_tokens,
                         model.max_context, frozenset(), lambda t: None)
    return tokens


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def test_w4a8_perplexity_within_5_percent_of_the_oracle(cli_eval):
    result, _ = cli_eval
    g = oracle.golden()
    assert result["model"] == str(DEFAULT_MODEL) and result["is_quantized"]
    assert result["n_tokens"] == g["n_tokens"] and result["context"] == g["context"]
    assert rel(result["perplexity"], g["perplexity"]) <= W4A8_PPL_REL, (result, g["perplexity"])
    print(f"\nW4A8 perplexity {result['perplexity']:.4f}, fp32 oracle {g['perplexity']:.4f} "
          f"({100 * (result['perplexity'] / g['perplexity'] - 1):+.2f}%)")


# --- item 4: teacher-forced agreement over all ten prompts ---------------------------------------

def forced_logits(model, prompt: str, continuation) -> np.ndarray:
    """[len(continuation), V]: the logits predicting each token of `continuation` after
    `prompt`, the continuation fed in (teacher forcing), in one prefill."""
    p = oracle.tokenizer().encode(prompt)
    tokens = np.concatenate([p, np.asarray(continuation[:-1], np.int32)])
    return model.prefill(tokens, model.new_state(tokens.size), all_logits=True)[p.size - 1:]


def log_softmax(logits):
    z = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def test_w4a8_top1_agrees_with_the_oracle_teacher_forced():
    """At every position of the fp32 oracle's greedy continuations of all ten prompts (stored),
    W4A8's argmax against the oracle's (its next token). Measured: 289/320 (90.3%): the Q4_0
    weights move logits by 1.0-3.0 where the oracle's top-two gap has a median of 0.7."""
    g, model = oracle.golden(), load_model(DEFAULT_MODEL)[1]
    hits = [np.argmax(forced_logits(model, p, g["greedy"][p]), axis=-1) == g["greedy"][p]
            for p in oracle.CANDIDATE_PROMPTS]
    rate = float(np.mean(hits))
    print(f"\nteacher-forced top-1 vs the fp32 oracle: {np.sum(hits)}/{np.size(hits)} "
          f"({100 * rate:.1f}%)")
    assert rate >= W4A8_TOP1_VS_ORACLE, rate


@pytest.fixture(scope="module")
def dequantised(tmp_path_factory):
    """The embedded model's 4-bit weights as an fp32 HF checkpoint (tests/model/export.py)."""
    return export.export_hf(DEFAULT_MODEL, tmp_path_factory.mktemp("default") / "dequantised")


def test_w4a8_against_fp32_on_the_same_weights(dequantised):
    """The same 4-bit weights, fp32 activations (fermijit's fp32 path) vs W4A8, teacher-forced
    on the oracle's continuations: what the 8-bit activations and the kernels cost. Measured:
    top-1 313/320, mean KL(fp32 || W4A8) 1.12e-3 nats."""
    g = oracle.golden()
    w4a8, fp32 = load_model(DEFAULT_MODEL)[1], load_model(dequantised)[1]
    top1, kl = [], []
    for p in oracle.CANDIDATE_PROMPTS:
        a, b = (log_softmax(forced_logits(m, p, g["greedy"][p])) for m in (fp32, w4a8))
        top1.append(a.argmax(axis=-1) == b.argmax(axis=-1))
        kl.append((np.exp(a) * (a - b)).sum(axis=-1))
    rate, mean_kl = float(np.mean(top1)), float(np.mean(kl))
    print(f"\nW4A8 vs fp32, same weights: top-1 {np.sum(top1)}/{np.size(top1)}, "
          f"mean KL {mean_kl:.3g} nats")
    assert rate >= W4A8_TOP1_VS_FP32 and mean_kl <= W4A8_KL_VS_FP32, (rate, mean_kl)


# --- item 3: the fp32 path against transformers, everywhere torch is -----------------------------

def test_fp32_path_matches_transformers_on_the_dequantised_weights(dequantised):
    """transformers and fermijit's fp32 path on the same (dequantised) weights: the prompt's
    logits and 32 greedy steps."""
    from tests.model import oracle as tiny_oracle

    if not tiny_oracle.has_transformers():
        pytest.skip("torch and transformers >= 5.24 are not importable")
    import torch

    torch.set_num_threads(1)
    prompt = oracle.tokenizer().encode(oracle.PROMPT)
    live = tiny_oracle.greedy_logits(oracle.load_hf(dequantised), prompt, oracle.N_STORED)
    model = load_model(dequantised, kv=KvKind.F32)[1]
    state = model.new_state(model.max_context)
    ours = model.prefill(prompt, state, all_logits=True)
    decode = np.stack([model.decode(int(t), state).copy() for t in live.tokens])
    assert_rel("prompt logits", live.prompt_logits, ours, FP32_VS_TRANSFORMERS)
    assert_rel("decode logits", live.decode_logits, decode, FP32_VS_TRANSFORMERS)
    greedy = np.concatenate([[ours[-1].argmax()], decode[:-1].argmax(axis=-1)])
    np.testing.assert_array_equal(greedy, live.tokens, "greedy tokens differ")


@needs_hf
def test_fp32_path_matches_the_oracle_perplexity():
    """The unquantised checkpoint through fermijit's fp32 forward: the golden figure, so the
    W4A8 gap above is quantisation, not the scoring."""
    from fermijit.evaluate import score

    g = oracle.golden()
    result = score(load_model(oracle.HF_DIR, kv=KvKind.F32)[1], oracle.sample_tokens(),
                   oracle.CONTEXT)
    assert rel(result.nll_sum, g["nll_sum"]) <= FP32_PPL_REL, (result.nll_sum, g["nll_sum"])
    assert greedy(load_model(oracle.HF_DIR, kv=KvKind.F32)[1], oracle.N_STORED) == \
        g["greedy"][oracle.PROMPT]


@needs_live
def test_live_oracle(live_model, cli_eval):
    g = oracle.golden()
    nll_sum = oracle.live_nll_sum(live_model, oracle.sample_tokens())
    assert rel(nll_sum, g["nll_sum"]) <= GOLDEN_NLL_REL, (nll_sum, g["nll_sum"])
    live_ppl = math.exp(nll_sum / (g["n_tokens"] - 1))
    assert rel(cli_eval[0]["perplexity"], live_ppl) <= W4A8_PPL_REL
    prompt = oracle.tokenizer().encode(oracle.PROMPT)
    live_tokens = oracle.live_greedy(live_model, prompt, oracle.N_GREEDY)
    assert live_tokens == g["greedy"][oracle.PROMPT][:oracle.N_GREEDY]
    assert greedy(load_model(DEFAULT_MODEL, kv=KvKind.F32)[1], oracle.N_GREEDY) == live_tokens


def test_golden_names_the_embedded_model():
    """A retrained or reconverted model, or an edited sample, must come with a new golden."""
    g = oracle.golden()  # asserts fingerprint, sample hash, context and prompts
    tokens = oracle.sample_tokens()
    assert tokens.size == g["n_tokens"] and tokens[0] == 0  # <|endoftext|> first, as in training
    assert np.isclose(g["perplexity"], math.exp(g["nll_sum"] / (g["n_tokens"] - 1)))
