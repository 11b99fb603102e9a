"""`bench longctx` on the embedded model: the report's structure and arithmetic (the speeds are
not tested: timed tests are noise)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fermijit import FermijitError
from fermijit.bench import longctx as bench_longctx
from fermijit.engine import DEFAULT_MODEL


def test_report_structure_and_arithmetic(capsys):
    r = bench_longctx.run(DEFAULT_MODEL, None, (300, 100), 2, False, 1, True, n_pairs=3)
    printed = json.loads(capsys.readouterr().out)
    assert printed["rows"] == r["rows"] and r["kv_cache"] == "q8_0"
    assert [row["tokens"] for row in r["rows"]] == [100, 300]          # sorted
    assert r["decode_base"]["positions"] == 64 and r["decode_base"]["tok_s"] > 0
    assert r["decode_tokens"] == 2 and r["pairs"] == 3
    per_position = (64 + 8) * 2 * 2 * 2                                # D, k and v, Hkv, layers
    base_rates = []
    for row in r["rows"]:
        assert row["cpu_prefill_tok_s"] == pytest.approx(row["tokens"] / row["cpu_prefill_s"])
        paired = row["paired"]
        assert len(paired["tok_s"]) == len(paired["base_tok_s"]) == 3
        assert paired["ratios"] == pytest.approx([b / a for a, b in zip(paired["base_tok_s"],
                                                                         paired["tok_s"])])
        assert row["decode_of_base"] == paired["ratio"] == pytest.approx(
            sorted(paired["ratios"])[1])                               # the median of 3
        assert row["decode_tok_s"] == pytest.approx(sorted(paired["tok_s"])[1])
        base_rates += paired["base_tok_s"]
        assert row["kv_nbytes"] == row["tokens"] * per_position and row["rss"] > 0
        assert "gpu_prefill_tok_s" not in row
        assert list(row["profile_ms"])[-1] == "token"
    assert r["decode_base"]["tok_s"] == pytest.approx(float(np.median(base_rates)))
    assert r["rows"][1]["cpu_prefill_s"] > r["rows"][0]["cpu_prefill_s"]  # cumulative
    assert r["rows"][0]["cpu_prefill_of_first"] == 1
    table = bench_longctx.format_report(r)
    assert "decode at 64 positions" in table and "KV MiB" in table and "pairs min-max" in table
    assert "a token at 300 positions against 64, op by op" in table


def test_paired_windows_decode_the_same_positions_again():
    """Each window starts from its state as it was: a rewound state decodes the same logits,
    and both states are left where they were (the next prefill continues from there)."""
    from fermijit.model.forward import load_model

    model = load_model(DEFAULT_MODEL)[1]
    tokens = np.arange(100, dtype=np.int32) % model.vocab_size
    base_state, state = model.new_state(64 + 3), model.new_state(100 + 3)
    model.prefill(tokens[:64], base_state)
    model.prefill(tokens, state)
    expected = model.decode(bench_longctx.FIRST_TOKEN, state.copy()).copy()
    base, at_length = bench_longctx.Rewound(base_state), bench_longctx.Rewound(state)
    paired = bench_longctx.paired_decode(model, base, at_length, 3, 2)
    assert len(paired["ratios"]) == 2 and base_state.position == 64 and state.position == 100
    ops = bench_longctx.profiled(model, base, at_length)
    assert list(ops)[-1] == "token" and ops["token"]["length"] > 0 and ops["token"]["base"] > 0
    assert any(op.startswith("attention") for op in ops)    # an op of its own: steps not joined
    assert base_state.position == 64 and state.position == 100
    np.testing.assert_array_equal(model.decode(bench_longctx.FIRST_TOKEN, state), expected)


def test_alternate_swaps_every_other_pair():
    from fermijit.bench.decode import alternate, pair_ratios

    calls = []
    pairs = alternate(range(4), lambda i: calls.append(("a", i)) or 1.0 + i,
                      lambda i: calls.append(("b", i)) or 2.0 * (1.0 + i), swap=True)
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2), ("b", 3),
                     ("a", 3)]
    assert pairs == [(1.0, 2.0), (2.0, 4.0), (3.0, 6.0), (4.0, 8.0)]
    assert pair_ratios(pairs) == [2.0] * 4


def test_bad_lengths():
    with pytest.raises(FermijitError, match="exceeds the model's context of 2048"):
        bench_longctx.run(DEFAULT_MODEL, None, (4096,), 2, False, 1, True)
    with pytest.raises(FermijitError, match="positive prompt lengths"):
        bench_longctx.run(DEFAULT_MODEL, None, (0, 10), 2, False, 1, True)
    with pytest.raises(FermijitError, match="--pairs must be at least 1"):
        bench_longctx.run(DEFAULT_MODEL, None, (10,), 2, False, 1, True, n_pairs=0)
