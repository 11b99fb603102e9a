"""The small findings of issue 30 (item 8), through the command line: `prune`'s default window on a
model of a shorter context, a manifest entry without its quant, and `generate >&-`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from fermijit.engine import DEFAULT_MODEL
from fermijit.model import convert
from tests.cli import run_cli
from tests.fermijit.test_hardening import assert_one_line
from tests.model import tiny


def test_prune_takes_a_default_window_a_short_context_holds(tmp_path, monkeypatch, capsys):
    """--ctx defaulted to 512: "--ctx must be between 1 and 256" on the tiny model, which
    has 256 positions, though no --ctx was given."""
    src = tiny.write_checkpoint(tmp_path / "hf")  # max_position_embeddings 256
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(tiny.CORPUS * 40))
    code, _, err = run_cli(monkeypatch, capsys, "prune", src, tmp_path / "out", "--text", text,
                           "--ratio", "0.25", "--max-tokens", "512")
    assert code == 0, err
    record = json.loads((tmp_path / "out" / "reap.json").read_text())
    assert record["calibration"]["context"] == 256
    code, _, err = run_cli(monkeypatch, capsys, "prune", src, tmp_path / "out2", "--text", text,
                           "--ratio", "0.25", "--ctx", "300")
    assert_one_line(code, err, "--ctx must be between 1 and 256")


def test_a_manifest_entry_without_its_quant_names_the_field(tmp_path, monkeypatch, capsys):
    model = tmp_path / "m"
    shutil.copytree(DEFAULT_MODEL, model)
    raw = json.loads((model / convert.MANIFEST).read_text())
    del raw["tensors"]["layers.0.mlp.experts_down"]["quant"]
    (model / convert.MANIFEST).write_text(json.dumps(raw))
    code, _, err = run_cli(monkeypatch, capsys, "generate", "--model", model, "x")
    assert_one_line(code, err, "tensors: layers.0.mlp.experts_down: missing required field "
                               "'quant'")


def test_generate_with_stdout_closed_says_the_text_went_nowhere():
    r = subprocess.run([sys.executable, "-m", "fermijit", "generate", "def f", "--max-tokens",
                        "4", "--temperature", "0", "--threads", "1"], stderr=subprocess.PIPE,
                       preexec_fn=lambda: os.close(1), timeout=300)
    err = r.stderr.decode()
    assert r.returncode == 0 and "Traceback" not in err, err
    assert "warning: standard output is closed: the generated text goes nowhere" in err
