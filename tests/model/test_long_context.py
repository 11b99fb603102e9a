"""Correct at length (issue 31 item 6), on tiny.LONG_CONTEXT (SENSITIVE with 40,960 positions):
the fp32 path against transformers over a 4096-token prompt (every 512th position's logits and
the greedy continuation); the Q8_0 cache near them; a snapshot taken at 30,000 tokens restoring
to the same logits. (RoPE past 65,536: tests/ops/test_rope.py; the GDN state after 32k tokens:
tests/ops/test_gated_delta.py.)"""

from __future__ import annotations

import numpy as np

from fermijit.cache.prefix_cache import PrefixCache
from fermijit.model import convert
from fermijit.model.forward import load_model
from fermijit.model.state import KvKind
from tests.model import oracle, tiny
from tests.model.oracle import LONG_CONTEXT_PROMPT, LONG_CONTEXT_ROWS, assert_rel, rel_error

# fp32 path against transformers at every 512th of 4096 positions, of each row's largest logit:
# the bound. Measured 6.2e-7 (prompt rows), 1.0e-6 (32 greedy steps).
FP32_AT_LENGTH = 1e-4
# The Q8_0 cache against transformers' fp32 over the same prompt: a bound on its noise, as
# tests/model/test_forward.py Q8_KV_NOISE at 16 tokens. Measured 3.9e-3 (prompt rows), 1.5e-2
# (decode, teacher-forced on transformers' tokens; its own greedy run takes 31 of the 32).
Q8_KV_NOISE_AT_LENGTH = 3e-2
SNAPSHOT_AT = 30_000


def continuation(model, prompt, tokens):
    """Logits at LONG_CONTEXT_ROWS of `prompt`, then after each of `tokens` fed in turn."""
    state = model.new_state(prompt.size + len(tokens) + 1)
    logits = model.prefill(prompt, state, all_logits=True)[LONG_CONTEXT_ROWS]
    return logits, np.stack([model.decode(int(t), state).copy() for t in tokens])


def test_fp32_path_matches_transformers_at_4096_tokens(tiny_dir):
    golden = oracle.golden_long_context()
    model = load_model(tiny_dir(tiny.LONG_CONTEXT), kv=KvKind.F32)[1]
    prompt_logits, decode_logits = continuation(model, LONG_CONTEXT_PROMPT, golden.tokens)
    for row, want, got in zip(LONG_CONTEXT_ROWS, golden.prompt_logits, prompt_logits):
        assert_rel(f"logits at position {row}", want, got, FP32_AT_LENGTH)
    assert_rel("decode logits", golden.decode_logits, decode_logits, FP32_AT_LENGTH)
    greedy = np.concatenate([[prompt_logits[-1].argmax()], decode_logits[:-1].argmax(axis=-1)])
    np.testing.assert_array_equal(greedy, golden.tokens, "greedy continuation differs")


def test_q8_cache_stays_near_transformers_at_4096_tokens(tiny_dir):
    golden = oracle.golden_long_context()
    model = load_model(tiny_dir(tiny.LONG_CONTEXT))[1]
    assert model.kv_kind is KvKind.Q8_0
    prompt_logits, decode_logits = continuation(model, LONG_CONTEXT_PROMPT, golden.tokens)
    for row, want, got in zip(LONG_CONTEXT_ROWS, golden.prompt_logits, prompt_logits):
        assert_rel(f"logits at position {row}", want, got, Q8_KV_NOISE_AT_LENGTH)
    assert_rel("decode logits", golden.decode_logits, decode_logits, Q8_KV_NOISE_AT_LENGTH)
    assert rel_error(golden.prompt_logits, prompt_logits) > 1e-5, "Q8_0 yet fp32 accuracy?"


def test_snapshot_at_30k_tokens_restores_to_the_same_logits(tiny_dir, tmp_path):
    """30,000 tokens prefilled (W4A8, the Q8_0 cache), snapshotted to disk; a fresh cache on
    the directory restores it, and the next tokens' logits are the uninterrupted run's, bit for
    bit. (The fp32 cache passed too; ~1 min of causal attention each on 2 cores.)"""
    convert.convert(tiny_dir(tiny.LONG_CONTEXT), tmp_path / "q4", show_progress=False)
    model = load_model(tmp_path / "q4")[1]
    tokens = np.random.default_rng(30).integers(0, 300, SNAPSHOT_AT + 3).astype(np.int32)
    context = SNAPSHOT_AT + 8
    state = model.new_state(context)
    logits = model.prefill(tokens[:SNAPSHOT_AT], state)
    assert np.isfinite(logits).all()
    writer = PrefixCache("long", directory=tmp_path / "snap", check=model.check_state)
    writer.add(tokens[:SNAPSHOT_AT], state, logits)
    reader = PrefixCache("long", directory=tmp_path / "snap", check=model.check_state)
    restored, restored_logits = reader.restore(tokens, context)
    assert restored is not None and restored.position == SNAPSHOT_AT
    assert restored_logits is None                         # tokens are left to prefill
    for t in tokens[SNAPSHOT_AT:]:
        after_restore = model.decode(int(t), restored).copy()    # decode's buffer is reused
        np.testing.assert_array_equal(after_restore, model.decode(int(t), state))
