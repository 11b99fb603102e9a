"""The test models are sensitive enough for their tolerances (issue 12, item 1): removing any part
of the model (a sublayer kind, the shared expert, RoPE, any norm's weights) moves its logits by
at least 10x every tolerance the model is compared under, so a model missing that part fails.
The ablations are tests/model/ablation.py's; the tolerances test_forward.py's and
test_oracle.py's (all in the measure max|diff| / max|logits|)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.model import ablation, oracle, test_forward, test_oracle, tiny

MARGIN = 10  # issue 12: each ablation at least 10x the tolerance

# The tolerances each model is held to, by the tests that compare whole-model logits. The W4A8
# comparisons hold every position to the tight bound but a measured few (test_forward.py: 3 of
# 48 against the W4A8 oracle, at most W4A8_FLIP; against the float64 reference each flip is
# explained by a code at a rounding tie, tests/model/flips.py), so an ablation must move most
# positions past the tight bound tenfold, and all past the loosest.
HELD = {
    tiny.SENSITIVE.name: {"FP32_VS_ORACLE": test_forward.FP32_VS_ORACLE,
                     "W4A8_VS_W4A8_ORACLE (all but 3 of 48 positions)":
                         test_forward.W4A8_VS_W4A8_ORACLE,
                     "W4A8_VS_REFERENCE (flips explained)": test_forward.W4A8_VS_REFERENCE,
                     "W4A8_FLIP (3 positions)": test_forward.W4A8_FLIP,
                     "ORACLE_REL (reference)": test_oracle.ORACLE_REL},
    tiny.HF_INIT.name: {"FP32_VS_ORACLE": test_forward.FP32_VS_ORACLE,
                   "W4A8_VS_REFERENCE (flips explained)": test_forward.W4A8_VS_REFERENCE,
                   "ORACLE_REL (reference)": test_oracle.ORACLE_REL},
}


MODELS = {m.name: m for m in (tiny.SENSITIVE, tiny.HF_INIT)}


@pytest.mark.parametrize("name", HELD)
def test_every_part_moves_the_logits_far_past_the_tolerances(tiny_dir, name):
    model = MODELS[name]
    moved = ablation.table(tiny_dir(model), oracle.golden(model).tokens)
    assert set(moved) == set(ablation.ABLATIONS)
    loosest, tightest = max(HELD[name].values()), min(HELD[name].values())
    weak = {part: float(rel.max()) for part, rel in moved.items() if rel.max() < MARGIN * loosest}
    assert not weak, (f"{name}: removing these moves the logits by less than {MARGIN}x "
                      f"the loosest tolerance {loosest:g}: {weak}")
    # Comparisons that let a few positions off by a rounding flip: an ablation must move far
    # more positions than that.
    few = {part: float(np.mean(rel > MARGIN * tightest)) for part, rel in moved.items()
           if np.mean(rel > MARGIN * tightest) < 0.5}
    assert not few, f"{name}: these move under half the positions past {MARGIN}x {tightest:g}"
