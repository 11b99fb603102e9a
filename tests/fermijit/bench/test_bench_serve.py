"""`bench serve` on the embedded model with tiny sizes: the report's structure and its counts
(the speeds themselves are not tested: timed tests are noise)."""

from __future__ import annotations

import json

import pytest

from tests.cli import run_cli

pytest.importorskip("uvicorn")
pytest.importorskip("httpx")


def test_report_structure_and_counts(monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "bench", "serve", "--prompt-tokens", 5,
                             "--tokens", 3, "--chat-tokens", 20, "--repeat", 1, "--json")
    assert code == 0, err
    r = json.loads(out)
    assert [x["streams"] for x in r["rounds"]] == [1, 2, 4, 8]
    for x in r["rounds"]:
        assert x["generated"] == 3 * x["streams"]  # ignore_eos: exactly --tokens each
        assert 0 < x["ttft_mean_s"] <= x["ttft_max_s"] < x["wall_s"]
        assert x["decode_tok_per_s"] > 0
    s = r["second_turn"]
    assert 20 <= s["first_turn_prompt_tokens"] <= s["cached_tokens"] < s["prompt_tokens"]
    assert s["ttft_cached_s"] > 0 and s["ttft_uncached_s"] > 0
