"""The float64 reference forward against transformers (the oracle, MODEL.md §8) on the tiny models.

transformers' outputs are stored in golden/ (tests/model/oracle.py), so the default run needs no
torch; where transformers is importable the oracle also runs live.
"""

from __future__ import annotations

import numpy as np
import pytest

from fermijit.model.config import load_config
from fermijit.model.reference import Reference
from fermijit.model.safetensors_io import Checkpoint
from fermijit.model.weights import load_text_weights
from tests.model import oracle, tiny
from tests.model.conftest import LAYOUTS
from tests.model.oracle import PROMPT, assert_rel

# max|diff| / max|ref| (issue 3 (a) asked 1e-4; issue 12: from the error measured). transformers
# runs fp32 with the chunked GDN prefill, which MODEL.md §8 measured at 1.5e-5 from the recurrent
# form on the real model; measured here: ~2e-6 (UNIT, HF_INIT, SENSITIVE).
ORACLE_REL = 2e-5
# The same transformers on another machine or torch build: only fp32 summation order differs.
GOLDEN_REL = 1e-5
# float64 against float64 with a different grouping of the same sums.
FLOAT64_REL = 1e-10

MODELS = {m.name: m for m in oracle.MODELS}


def reference(directory) -> Reference:
    cfg = load_config(directory).text_config
    return Reference(cfg, load_text_weights(cfg, Checkpoint(directory), np.float64))


def run_reference(model: Reference, tokens: np.ndarray):
    """Prompt logits, then one decode step per token of `tokens` (teacher-forced)."""
    state = model.new_state()
    prompt_logits = model.forward(PROMPT, state)
    decode_logits = np.stack([model.forward([t], state)[0] for t in tokens])
    return prompt_logits, decode_logits


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_reference_matches_stored_oracle(tiny_dir, model, layout):
    golden = oracle.golden(MODELS[model])
    prompt_logits, decode_logits = run_reference(reference(tiny_dir(MODELS[model], layout)),
                                                 golden.tokens)
    assert_rel("prompt logits", golden.prompt_logits, prompt_logits, ORACLE_REL)
    assert_rel("decode logits", golden.decode_logits, decode_logits, ORACLE_REL)
    greedy = np.concatenate([[prompt_logits[-1].argmax()], decode_logits[:-1].argmax(axis=-1)])
    np.testing.assert_array_equal(greedy, golden.tokens, "greedy tokens differ")


def test_prefill_then_decode_equals_one_prefill(tiny_dir):
    """State correctness: prefill(n) then decode(m) gives prefill(n+m)'s logits everywhere."""
    model = reference(tiny_dir(tiny.UNIT))
    whole = model.forward(PROMPT, model.new_state())
    state = model.new_state()
    parts = [model.forward(PROMPT[:5], state)] + [model.forward(PROMPT[i:i + 1], state)
                                                  for i in range(5, 9)]
    parts.append(model.forward(PROMPT[9:], state))
    assert_rel("logits", whole, np.concatenate(parts), FLOAT64_REL)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_live_oracle(live_oracle, tiny_dir, model, layout):
    golden = oracle.golden(MODELS[model])
    live = live_oracle(MODELS[model], layout)
    np.testing.assert_array_equal(live.tokens, golden.tokens, "transformers' greedy tokens moved")
    assert_rel("oracle vs golden, prompt", golden.prompt_logits, live.prompt_logits, GOLDEN_REL)
    assert_rel("oracle vs golden, decode", golden.decode_logits, live.decode_logits, GOLDEN_REL)
    ref_prompt, ref_decode = run_reference(reference(tiny_dir(MODELS[model], layout)),
                                           live.tokens)
    assert_rel("prompt logits", live.prompt_logits, ref_prompt, ORACLE_REL)
    assert_rel("decode logits", live.decode_logits, ref_decode, ORACLE_REL)
