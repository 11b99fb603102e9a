"""A prompt of 1100 tokens, across two boundaries of the 512-token prefill block (issue 12,
item 5): prefill in passes against one pass, against other pass sizes, and against one token at a
time across the first boundary; against transformers (fp32 path, SENSITIVE: stored rows of its
logits around each boundary, and live); and the W4A8 path against the float64 reference over
every position, each 8-bit rounding flip explained (HF_INIT_LONG: on SENSITIVE the flips of 1100
tokens, fp32 against float64, persist in the state and add up to 1.1e-2 of the logits, measured;
on the smoother model they stay isolated: 28 of 1100 positions, up to 1.4e-3).
"""

from __future__ import annotations

import numpy as np
import pytest

from fermijit.model import convert, forward
from fermijit.model.forward import load_model
from fermijit.model.reference import Reference
from fermijit.model.state import KvKind
from tests.model import oracle, tiny
from tests.model import flips
from tests.model.oracle import LONG_PROMPT, LONG_ROWS, assert_rel, assert_rel_but_flips
from tests.model.test_forward import (FP32_STATE_REL, FP32_VS_ORACLE, W4A8_FLIP, W4A8_STATE_REL,
                                      W4A8_VS_REFERENCE)

FIRST, LAST = 500, 530  # one token at a time over these positions, across position 512
# The 8-bit rounding flips the W4A8 run needs against the float64 reference over the 1100 tokens
# (tests/model/flips.py), each explained by a code at a tie: measured 41 (the first at 330; the
# engine's fp32 state drifts from float64 with the positions, so the codes that flip lie up to
# 9.2e-4 from their tie by the end), the same on AVX-512, AVX2 and SSSE3 of Intel hosts; 42 on an
# AMD EPYC (Zen 5: LLVM's znver5 code, fp32 in another order), already at 1ae22aa.
HF_INIT_LONG_FLIPS = 42
# With the Q8_0 cache a key or value code rounded the other way stays in the cache and moves every
# later position a little, so flips compound (at position 94 no single flip explains the row):
# counted instead, positions past W4A8_VS_REFERENCE measured 130 of 1100 (worst 1.8e-3).
HF_INIT_LONG_Q8_KV_OFF = 130


def passes(model, block: int) -> np.ndarray:
    """All logits of LONG_PROMPT, prefilled in passes of `block` tokens."""
    saved = forward.PREFILL_BLOCK
    forward.PREFILL_BLOCK = block
    try:
        return model.prefill(LONG_PROMPT, model.new_state(LONG_PROMPT.size), all_logits=True)
    finally:
        forward.PREFILL_BLOCK = saved


def across_the_boundary(model) -> np.ndarray:
    """Prefill up to FIRST, decode FIRST..LAST one at a time, prefill the rest: all logits."""
    state = model.new_state(LONG_PROMPT.size)
    head = model.prefill(LONG_PROMPT[:FIRST], state, all_logits=True)
    middle = np.stack([model.decode(int(t), state).copy() for t in LONG_PROMPT[FIRST:LAST]])
    tail = model.prefill(LONG_PROMPT[LAST:], state, all_logits=True)
    return np.concatenate([head, middle, tail])


def assert_state_handoffs(model, rel, bitwise: bool = False):
    """With `bitwise`, passes of 512 and 300 give one pass's very bits (the W4A8 path: every
    prefill kernel's row is independent of the pass length; numpy's matmul for the router and
    GDN gates was not: 2.4e-6, then 8-bit flips of 1.3e-3)."""
    whole = passes(model, 2048)                               # one pass
    for block in (512, 300, 7):  # 7: a pass of few tokens over many keys (attention ranges)
        split = passes(model, block)
        assert_rel(f"passes of {block} vs one pass", whole, split, rel)
        assert not bitwise or np.array_equal(whole, split), f"passes of {block}: other bits"
    assert_rel("one token at a time over 500..530", whole, across_the_boundary(model), rel)
    return whole


@pytest.fixture(scope="module")
def sensitive_fp32(tiny_dir):
    model = load_model(tiny_dir(tiny.SENSITIVE), kv=KvKind.F32)[1]  # the oracle's fp32 cache
    return model, assert_state_handoffs(model, FP32_STATE_REL)


def test_fp32_prefill_passes_and_single_tokens_agree(sensitive_fp32):
    """(The comparisons are in the fixture, shared with the oracle tests.)"""


def test_fp32_path_matches_the_stored_oracle(sensitive_fp32):
    _, logits = sensitive_fp32
    assert_rel("logits", oracle.golden_long(tiny.SENSITIVE), logits[LONG_ROWS], FP32_VS_ORACLE)


def test_fp32_path_matches_the_live_oracle(sensitive_fp32, tiny_dir):
    if not oracle.has_transformers():
        pytest.skip("torch and transformers >= 5.24 are not importable: goldens stand in")
    _, logits = sensitive_fp32
    live = oracle.live_long(tiny_dir(tiny.SENSITIVE))
    assert_rel("logits", live, logits[LONG_ROWS], FP32_VS_ORACLE)


@pytest.mark.parametrize("kv", [KvKind.F32, KvKind.Q8_0], ids=["f32", "q8_0"])
def test_w4a8_matches_the_reference_over_1100_tokens(tiny_dir, tmp_path, kv):
    """With either KV cache: the Q8_0 one against the reference that rounds q, k, v so."""
    convert.convert(tiny_dir(tiny.HF_INIT_LONG), tmp_path / "q4", show_progress=False)
    model = load_model(tmp_path / "q4", kv=kv)[1]
    ours = assert_state_handoffs(model, W4A8_STATE_REL, bitwise=True)
    cfg, weights, _ = convert.load_converted(tmp_path / "q4")
    reference = Reference(cfg.text_config, weights, quantize_activations=True,
                          quantize_kv=kv is KvKind.Q8_0)
    if kv is KvKind.Q8_0:
        expected = reference.forward(LONG_PROMPT, reference.new_state())
        assert_rel_but_flips("logits", expected, ours, W4A8_VS_REFERENCE, W4A8_FLIP,
                             HF_INIT_LONG_Q8_KV_OFF)
        return
    found = flips.follow("logits", reference, LONG_PROMPT, ours, W4A8_VS_REFERENCE,
                         HF_INIT_LONG_FLIPS)
    print(f"\nHF_INIT_LONG W4A8 vs the float64 reference: {len(found)} flips, margins up to "
          f"{max(f.margin for f in found):.2g}")
