"""The embedded default model end to end (issue 4): fermijit's W4A8 perplexity of a held-out
sample and its greedy continuation of a fixed prompt, against transformers in fp32 on the
unquantised weights (tests/model/default_oracle.py). The oracle's figures are stored in
golden/default_model_oracle.json; where the HF checkpoint (build/default-hf, not committed) and
transformers are at hand, the oracle also runs live.
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
from fermijit.ops.sampling import Sampler
from tests.model import default_oracle as oracle

# Issue 4: W4A8 perplexity within 5% of the fp32 oracle's. Measured: 39.933 vs 39.686 (+0.62%).
W4A8_PPL_REL = 0.05
# fermijit's fp32 path vs transformers' fp32, same weights: summation order only. Measured 2e-8.
FP32_PPL_REL = 1e-5
# transformers now vs the stored run: another machine or torch build reorders fp32 sums.
GOLDEN_NLL_REL = 1e-5

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


def test_greedy_first_16_tokens_are_the_oracle_s():
    g = oracle.golden()
    assert greedy(load_model(DEFAULT_MODEL)[1], oracle.N_GREEDY) == \
        g["greedy"][oracle.PROMPT][:oracle.N_GREEDY]


@needs_hf
def test_fp32_path_matches_the_oracle_perplexity():
    """The unquantised checkpoint through fermijit's fp32 forward: the golden figure, so the
    W4A8 gap above is quantisation, not the scoring."""
    from fermijit.evaluate import score

    g = oracle.golden()
    result = score(load_model(oracle.HF_DIR)[1], oracle.sample_tokens(), oracle.CONTEXT)
    assert rel(result.nll_sum, g["nll_sum"]) <= FP32_PPL_REL, (result.nll_sum, g["nll_sum"])
    assert greedy(load_model(oracle.HF_DIR)[1], oracle.N_STORED) == g["greedy"][oracle.PROMPT]


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
    assert greedy(load_model(DEFAULT_MODEL)[1], oracle.N_GREEDY) == live_tokens


def test_golden_names_the_embedded_model():
    """A retrained or reconverted model, or an edited sample, must come with a new golden."""
    g = oracle.golden()  # asserts fingerprint, sample hash, context and prompts
    tokens = oracle.sample_tokens()
    assert tokens.size == g["n_tokens"] and tokens[0] == 0  # <|endoftext|> first, as in training
    assert np.isclose(g["perplexity"], math.exp(g["nll_sum"] / (g["n_tokens"] - 1)))
