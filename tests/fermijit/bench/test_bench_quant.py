"""`bench quant` (issue 34 item 5) on the 256-wide tiny checkpoint, whose Q4_K_M has K-quants:
each mix converted, scored and decoded; the bytes a token reads and the bits per weight follow
from the mixes' kinds."""

from __future__ import annotations

import json

import pytest

from tests.cli import run_cli
from tests.model import gguf_data
from tests.model.default_oracle import SAMPLE as HELDOUT_SAMPLE


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return gguf_data.write_checkpoint(tmp_path_factory.mktemp("bench-quant") / "hf",
                                      gguf_data.WIDE)


def test_bench_quant_reports_each_mix(wide, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "bench", "quant", "--hf", wide, "--text",
                             HELDOUT_SAMPLE, "--ctx", "64", "--max-tokens", "200",
                             "--decode-tokens", "4", "--rounds", "2", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["tokens"] == 200 and report["fp32"]["n_scored"] == 199
    q4_0, q4_k_m = report["rows"]
    assert (q4_0["mix"], q4_k_m["mix"]) == ("q4_0", "q4_k_m")
    for row in (q4_0, q4_k_m):
        assert row["n_scored"] == 199 and len(row["decode_tok_s_rounds"]) == 2
        assert abs(row["excess_nll"]) < 0.1   # random weights: 4-5 bits cost little NLL
    # Q4_0 is 4.5 bits (an fp16 scale per 32), its head Q8_0 8.5; Q4_K_M adds Q6_K/Q8_0
    assert 4.5 < q4_0["matrix_bits"] < 8.5
    assert q4_k_m["matrix_bits"] > q4_0["matrix_bits"]
    assert q4_k_m["bytes_per_token"] > q4_0["bytes_per_token"]


def test_bench_quant_takes_an_hf_checkpoint_only(monkeypatch, capsys, tmp_path):
    from fermijit import engine

    code, _, err = run_cli(monkeypatch, capsys, "bench", "quant", "--hf", engine.DEFAULT_MODEL,
                           "--text", HELDOUT_SAMPLE)
    assert code == 2 and "bench quant takes an HF checkpoint directory" in err
