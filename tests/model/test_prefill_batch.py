"""Prefill of several sequences in one pass (Model.prefill_batch, issue 28 item 5) against each
prefilled alone: bit for bit, logits and states, however the passes are cut (`pass_size`), so a
request's answer at temperature 0 does not depend on what was prefilled beside it."""

from __future__ import annotations


import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.engine import DEFAULT_MODEL
from fermijit.model.forward import load_model, pass_size

CONTEXT = 160


@pytest.fixture(scope="module")
def model():
    return load_model(DEFAULT_MODEL)[1]


def _assert_states_equal(a, b, what: str) -> None:
    assert a.position == b.position, what
    for i, (x, y) in enumerate(zip(a.layers, b.layers)):
        assert type(x) is type(y), what
        for j, (p, q) in enumerate(zip(x.arrays, y.arrays)):  # a Q8_0 cache: codes and scales
            np.testing.assert_array_equal(p, q, err_msg=f"{what}: layer {i} array {j}")


def _heads(model, rng, n_seen):
    """A state per entry of `n_seen`, that many random tokens prefilled already (0: fresh)."""
    states = []
    for n in n_seen:
        s = model.new_state(CONTEXT)
        if n:
            model.prefill(rng.integers(0, model.vocab_size, n), s)
        states.append(s)
    return states


@pytest.mark.parametrize("align, max_rows", [(None, 512), (16, 40), (None, 7)],
                         ids=["one-pass", "align16-rows40", "rows7"])
def test_rows_are_separate_prefills_exactly(model, rng, align, max_rows):
    # Ragged: one-token and two-token prompts, one longer than max_rows, states that have seen
    # 0 to 37 tokens (a restored prefix), a span of one token before an align boundary (15 + 1).
    n_seen = [0, 3, 0, 15, 37, 0]
    lengths = [23, 1, 2, 30, 61, 9]
    prompts = [rng.integers(0, model.vocab_size, n).astype(np.int32) for n in lengths]
    head_rng = np.random.default_rng(7)
    alone_states = _heads(model, head_rng, n_seen)
    alone = [model.prefill(p, s, align=align).copy() for p, s in zip(prompts, alone_states)]
    head_rng = np.random.default_rng(7)
    states = _heads(model, head_rng, n_seen)
    fed = [[] for _ in prompts]
    got = model.prefill_batch(prompts, states, align=align, max_rows=max_rows,
                              on_block=lambda b, n: fed[b].append((n, states[b].position)))
    for b, (want, logits) in enumerate(zip(alone, got)):
        np.testing.assert_array_equal(logits, want, err_msg=f"sequence {b} logits")
        _assert_states_equal(alone_states[b], states[b], f"sequence {b}")
        assert sum(n for n, _ in fed[b]) == lengths[b]
        if align is not None:  # every boundary crossed is seen by on_block (the snapshots)
            ends = {pos for _, pos in fed[b]}
            boundaries = range(-(-n_seen[b] // align) * align, n_seen[b] + lengths[b] + 1, align)
            assert {p for p in boundaries if p > n_seen[b]} <= ends, f"sequence {b}: {fed[b]}"


def test_passes_hold_at_most_max_rows(model, rng):
    """Each forward takes at most max_rows rows (the workspace stays bounded)."""
    prompts = [rng.integers(0, model.vocab_size, n).astype(np.int32) for n in (20, 20, 20)]
    states = [model.new_state(CONTEXT) for _ in prompts]
    passes = []
    model.prefill_batch(prompts, states, max_rows=25,
                        on_block=lambda b, n: passes.append(n))
    assert sum(passes) == 60 and max(passes) <= 25


def test_bad_calls_change_nothing(model, rng):
    prompt = rng.integers(0, model.vocab_size, 8).astype(np.int32)
    s = model.new_state(CONTEXT)
    full = model.new_state(8)
    model.prefill(prompt, full)
    for args, match in [(([prompt, prompt], [s, s]), "appears twice"),
                        (([prompt], [s, full]), "2 states"),
                        (([prompt, prompt], [s, full]), "context full"),
                        (([prompt, np.array([model.vocab_size])], [s, model.new_state(4)]),
                         "token ids"),
                        (([prompt, np.zeros(0, np.int32)], [s, model.new_state(4)]), "non-empty")]:
        with pytest.raises(FermijitError, match=match):
            model.prefill_batch(*args)
        assert s.position == 0 and not s.layers[0].recurrent.any()


@pytest.mark.parametrize("align", [None, 5, 16])
def test_pass_size_leaves_one_token_passes_where_spans_are_one_token(align):
    """However the passes are cut (random limits), the one-token passes fall at the same
    positions as with the default limit: where a span between align boundaries is one token."""
    rng = np.random.default_rng(3)
    for _ in range(200):
        start, n = int(rng.integers(0, 40)), int(rng.integers(1, 60))

        def ones(limits):
            pos, singles = start, set()
            while pos < start + n:
                k = pass_size(pos, start + n - pos, align, limits())
                if k == 1:
                    singles.add(pos)
                pos += k
            return singles

        assert ones(lambda: None) == ones(lambda: int(rng.integers(1, 12)))
