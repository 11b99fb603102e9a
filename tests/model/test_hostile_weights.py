"""Damage the whole-tensor load check does not reach (issue 30 items 7 and 9): past its 4 MiB
budget only a tensor's sample is checked at load. Zeros over half of lm_head, of the embedding
or of a layer's experts in the embedded model ran with rc 0 and another text on main; now one
line and exit 2. An HF checkpoint with NaN weights is refused by `generate` and `prune` as
`convert` refuses it."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from fermijit.engine import DEFAULT_MODEL
from fermijit.model import convert, manifest
from fermijit.model.safetensors_io import SafetensorsFile
from tests.cli import run_cli
from tests.fermijit.test_hardening import assert_one_line
from tests.model import tiny

FLAGS = ("--max-tokens", "8", "--temperature", "0", "--threads", "1")


def _generate(monkeypatch, capsys, model, prompt="def f"):
    return run_cli(monkeypatch, capsys, "generate", "--model", model, prompt, *FLAGS)


@pytest.fixture(scope="module")
def answer():
    """The embedded model's greedy answer, from a process of its own."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "fermijit", "generate", "def f", *FLAGS],
                       capture_output=True, timeout=300)
    assert r.returncode == 0
    return r.stdout.decode()


def _zero(path, stored: str, start: float, fraction: float) -> None:
    f = SafetensorsFile(path / convert.WEIGHTS)
    info = f.tensors[stored]
    n = info.end - info.begin
    with open(path / convert.WEIGHTS, "r+b") as fh:
        fh.seek(f.data_start + info.begin + int(n * start))
        fh.write(bytes(int(n * fraction)))


@pytest.mark.parametrize("stored", ["lm_head.qs", "embed_tokens", "layers.3.mlp.experts_down.qs",
                                    "layers.5.mlp.experts_gate_up.d"])
def test_damage_past_the_load_budget_is_one_line(stored, tmp_path, monkeypatch, capsys):
    model = tmp_path / "m"
    shutil.copytree(DEFAULT_MODEL, model)
    name = stored.removesuffix(".qs").removesuffix(".d")
    _zero(model, stored, 0.25, 0.5)
    code, _, err = _generate(monkeypatch, capsys, model)
    # "sampled": past the budget of tensors checked whole (the smallest, 4 MiB in all)
    assert_one_line(code, err, f"tensor {name} does not match its sampled checksum")


def test_one_expert_zeroed_is_found(tmp_path, monkeypatch, capsys):
    """Each expert of a layer holds a sampled chunk of its quants and of its scales."""
    model = tmp_path / "m"
    shutil.copytree(DEFAULT_MODEL, model)
    n_experts = manifest.read_manifest(model).tensors["layers.2.mlp.experts_down"].shape[0]
    _zero(model, "layers.2.mlp.experts_down.qs", 7 / n_experts, 1 / n_experts)
    monkeypatch.setattr(manifest, "LOAD_CHECK_NBYTES", 0)  # as for a big model
    code, _, err = _generate(monkeypatch, capsys, model)
    assert_one_line(code, err, "tensor layers.2.mlp.experts_down does not match its sampled")


def test_the_sound_model_answers_the_same(tmp_path, monkeypatch, capsys, answer):
    model = tmp_path / "m"
    shutil.copytree(DEFAULT_MODEL, model)
    code, out, err = _generate(monkeypatch, capsys, model)
    assert code == 0 and out == answer, err


def test_samples_cover_every_expert():
    for nbytes, n_experts in ((10 ** 6, 1), (3 * 10 ** 6 + 17, 128), (5000, 4), (100, 1)):
        spans = manifest.sample_spans(nbytes, n_experts)
        assert spans[0][0] == 0 and spans[-1][1] > nbytes - 64
        assert all(a % 64 == 0 and a < b <= nbytes for a, b in spans)
        for e in range(n_experts):  # every expert's slice holds a chunk's start
            lo, hi = e * nbytes // n_experts, (e + 1) * nbytes // n_experts
            assert any(lo <= a < hi for a, _ in spans) or len(spans) == 1, (nbytes, e)


@pytest.fixture(scope="module")
def nan_checkpoint(tmp_path_factory):
    weights = tiny.random_weights()
    name = next(n for n in sorted(weights) if "mlp.experts" in n)
    weights[name].reshape(-1)[123] = np.nan
    return tiny.write_checkpoint(tmp_path_factory.mktemp("nan") / "hf", weights=weights)


def test_generate_refuses_an_hf_checkpoint_with_nan_weights(nan_checkpoint, monkeypatch,
                                                             capsys):
    code, _, err = _generate(monkeypatch, capsys, nan_checkpoint, "the cat")
    assert_one_line(code, err, "holds NaN or infinite values; refusing to run it")


def test_prune_refuses_an_hf_checkpoint_with_nan_weights(nan_checkpoint, tmp_path, monkeypatch,
                                                          capsys):
    text = tmp_path / "calibration.txt"
    text.write_text(" ".join(tiny.CORPUS * 4))
    code, _, err = run_cli(monkeypatch, capsys, "prune", nan_checkpoint, tmp_path / "out",
                           "--text", text, "--ratio", "0.25", "--ctx", "32")
    assert_one_line(code, err, "holds NaN or infinite values")
    assert not (tmp_path / "out").exists()
