"""`bench longctx` on the embedded model: the report's structure and arithmetic (the speeds are
not tested: timed tests are noise)."""

from __future__ import annotations

import json

import pytest

from fermijit import FermijitError
from fermijit.bench import longctx as bench_longctx
from fermijit.engine import DEFAULT_MODEL


def test_report_structure_and_arithmetic(capsys):
    r = bench_longctx.run(DEFAULT_MODEL, None, (300, 100), 2, False, 1, True)
    printed = json.loads(capsys.readouterr().out)
    assert printed["rows"] == r["rows"] and r["kv_cache"] == "q8_0"
    assert [row["tokens"] for row in r["rows"]] == [100, 300]          # sorted
    assert r["decode_base"]["positions"] == 64 and r["decode_base"]["tok_s"] > 0
    per_position = (64 + 8) * 2 * 2 * 2                                # D, k and v, Hkv, layers
    for row in r["rows"]:
        assert row["cpu_prefill_tok_s"] == pytest.approx(row["tokens"] / row["cpu_prefill_s"])
        assert row["decode_of_base"] == pytest.approx(row["decode_tok_s"]
                                                      / r["decode_base"]["tok_s"])
        assert row["kv_nbytes"] == row["tokens"] * per_position and row["rss"] > 0
        assert "gpu_prefill_tok_s" not in row
    assert r["rows"][1]["cpu_prefill_s"] > r["rows"][0]["cpu_prefill_s"]  # cumulative
    assert r["rows"][0]["cpu_prefill_of_first"] == 1
    table = bench_longctx.format_report(r)
    assert "decode at 64 positions" in table and "KV MiB" in table


def test_bad_lengths():
    with pytest.raises(FermijitError, match="exceeds the model's context of 2048"):
        bench_longctx.run(DEFAULT_MODEL, None, (4096,), 2, False, 1, True)
    with pytest.raises(FermijitError, match="positive prompt lengths"):
        bench_longctx.run(DEFAULT_MODEL, None, (0, 10), 2, False, 1, True)
