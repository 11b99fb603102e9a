"""`bench prune` (issue 15 item 4) on the tiny model with planted never-routed experts: REAP and
frequency pruning find them, so their perplexity is the full model's; every row is reported."""

from __future__ import annotations

import json

import pytest

from fermijit.model import convert
from tests.model import tiny
from tests.cli import run_cli
from tests.model.test_reap import PRUNED_VS_FULL, calibration_text, planted_weights


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-prune")
    src = tiny.write_checkpoint(root / "hf", "fused", "F32", weights=planted_weights())
    convert.convert(src, root / "fermijit", show_progress=False)
    return root / "fermijit"


def test_bench_prune_reports_every_criterion(planted, tmp_path, monkeypatch, capsys):
    text = calibration_text(tmp_path)
    heldout = tmp_path / "heldout.txt"
    heldout.write_text("A tiny model reads a held-out text: the fox and the dog sat on a log.")
    monkeypatch.setattr("sys.argv", ["fermijit", "bench", "prune", "--model", str(planted),
                                     "--text", str(text), "--heldout", str(heldout), "--keep",
                                     "6", "--ratio", "0.5", "--ctx", "32", "--max-tokens",
                                     "128", "--json"])
    from fermijit import cli
    cli.main()
    report = json.loads(capsys.readouterr().out)
    assert [(r["model"], r["experts"]) for r in report["rows"]] == [
        ("full", 8), ("reap", 6), ("frequency", 6), ("random", 6), ("reap", 4),
        ("frequency", 4), ("random", 4)]
    rows = {r["model"]: r for r in report["rows"] if r["experts"] in (6, 8)}
    assert report["calibration"]["n_tokens"] == 128 and report["heldout_tokens"] > 10
    assert report["eval_context"] == 32  # scored in windows of --ctx, as calibrated
    full = rows["full"]
    for name in ("reap", "frequency"):
        assert abs(rows[name]["perplexity"] / full["perplexity"] - 1) <= PRUNED_VS_FULL
    for name in ("reap", "frequency", "random"):
        assert rows[name]["experts"] == 6 and rows[name]["weights_nbytes"] < full["weights_nbytes"]
        assert rows[name]["change"] == pytest.approx(rows[name]["perplexity"] / full["perplexity"]
                                                     - 1)
    # The held-out routing never reaches the planted experts: dropping them drops no slot; at
    # 4 of 8 live ones go, and the random pick (seed 0) drops live ones at 6 already.
    shares = {(r["model"], r["experts"]): r["dropped_share"] for r in report["rows"]}
    assert shares[("full", 8)] == shares[("reap", 6)] == shares[("frequency", 6)] == 0
    assert all(0 < shares[(name, 4)] < 1 for name in ("reap", "frequency", "random"))
    assert 0 < shares[("random", 6)] < 1
    assert len(report["layers"]) == 4  # tiny's layers; 6 live experts of 8 in each
    assert all(1 < layer["effective_experts"] <= 6 + 1e-9 for layer in report["layers"])


def test_bench_prune_table_has_the_dropped_slots_and_the_layers(planted, tmp_path, monkeypatch,
                                                                capsys):
    text = calibration_text(tmp_path)
    code, out, _ = run_cli(monkeypatch, capsys, "bench", "prune", "--model", planted, "--text",
                           text, "--heldout", text, "--keep", "6", "--ctx", "32",
                           "--max-tokens", "64")
    lines = out.splitlines()
    assert code == 0 and "dropped slots" in lines[1] and lines[2].startswith("full ")
    assert lines[2].split()[4] == lines[3].split()[4] == "0.00%"  # full, reap
    layers = lines[lines.index(next(l for l in lines if l.startswith("per layer"))) + 2:]
    assert [int(l.split()[0]) for l in layers] == [0, 1, 2, 3]


def test_bench_prune_needs_a_fermijit_model(tmp_path, monkeypatch, capsys):
    src = tiny.write_checkpoint(tmp_path / "hf", "fused", "F32")
    text = calibration_text(tmp_path)
    code, _, err = run_cli(monkeypatch, capsys, "bench", "prune", "--model", src, "--text", text,
                        "--heldout", text, "--keep", "4")
    assert code == 2 and "takes a fermijit model" in err and err.count("\n") == 1
    code, _, err = run_cli(monkeypatch, capsys, "bench", "prune", "--text", text, "--heldout", text)
    assert code == 2 and "give --keep or --ratio" in err and err.count("\n") == 1
