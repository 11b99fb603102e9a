"""REAP expert pruning (issue 15): a tiny model with planted never-routed experts loses exactly
those and its outputs do not change; saliencies equal the numpy reference; the pruned fermijit
model and HF checkpoint are what they claim; bad arguments are one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors.numpy

from fermijit import FermijitError
from fermijit.model import convert, prune, reap
from fermijit.model.forward import load_model
from fermijit.model.reference import as_w4a8
from fermijit.model.safetensors_io import Checkpoint
from fermijit.model.weights import load_text_weights
from tests.model import tiny
from tests.model.oracle import assert_rel
from tests.cli import run_cli

N_EXPERTS, TOP_K = 8, 2                                   # tiny.UNIT
# Per layer, the experts whose router row is zero. The other rows hold two pairs (r, -r): for any
# input two of those four logits are > 0, so a logit of exactly 0 never makes the top 2.
PLANTED = {0: (5, 7), 1: (0, 3), 2: (2, 6), 3: (1, 4)}
LIVE = np.array([[e for e in range(N_EXPERTS) if e not in PLANTED[i]] for i in PLANTED])
CONTEXT = 32
TOKENS = np.random.default_rng(1).integers(0, tiny.TEXT_CONFIG["vocab_size"], 3 * CONTEXT + 5)
PROMPT = np.random.default_rng(2).integers(0, tiny.TEXT_CONFIG["vocab_size"], 40)
# Issue 15: pruning never-routed experts leaves the outputs as they were, to 1e-6 relative. The
# kept experts' bytes are copied, so only the router's [T, E] matmul may round differently with
# fewer rows (a different BLAS blocking), and the fp32 path's numpy matmuls over other shapes.
# Measured: 2.8e-7 (fp32), 0 (W4A8).
PRUNED_VS_FULL = 1e-6
# The same through transformers (torch's CPU matmuls): its router's product over half the rows
# blocks differently per CPU; measured 1.6e-6 (22 of 5120 logits past 1e-6, RMS 6.9e-7) on an
# AVX2-only Zen 3 (within 1e-6 on the earlier AVX-512 machines); greedy tokens identical.
PRUNED_VS_FULL_TORCH = 5e-6
# Saliency vs reap.reference on the same layer inputs: fp32 path, numpy matmul rounding only.
# Measured 1.7e-8.
FP32_SALIENCY_REL = 1e-5
# W4A8: the reference quantises activations per 32-block as the kernels do (W4A8, exact-integer),
# so only fp32 rounding differs, unless it moves an activation across a Q8 rounding boundary
# (as tests/model/test_forward.py W4A8_VS_REFERENCE). Measured 3.6e-8.
W4A8_SALIENCY_REL = 1e-3


def planted_weights() -> dict[str, np.ndarray]:
    w = tiny.random_weights(0)
    for i, dead in PLANTED.items():
        name = f"model.language_model.layers.{i}.mlp.gate.weight"
        r = w[name].copy()
        live = LIVE[i]
        r[live[1]], r[live[3]] = -r[live[0]], -r[live[2]]
        r[list(dead)] = 0
        w[name] = r
    return w


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The planted model as an HF checkpoint (fused; split in 3 shards) and as a fermijit model."""
    root = tmp_path_factory.mktemp("reap")
    w = planted_weights()
    made = {"hf-fused": tiny.write_checkpoint(root / "hf-fused", "fused", "F32", weights=w),
            "hf-split": tiny.write_checkpoint(root / "hf-split", "split", "F32", n_shards=3,
                                              weights=w)}
    convert.convert(made["hf-fused"], root / "fermijit", show_progress=False)
    made["fermijit"] = root / "fermijit"
    return made


def outputs(directory) -> np.ndarray:
    """Logits of PROMPT (every position, prefill) and of one decode step after it."""
    _, model = load_model(directory)
    state = model.new_state(PROMPT.size + 1)
    prompt = model.prefill(PROMPT, state, all_logits=True)
    return np.concatenate([prompt, model.decode(int(PROMPT[0]), state)[None]])


@pytest.mark.parametrize("kind", ["fermijit", "hf-fused", "hf-split"])
def test_pruning_removes_the_never_routed_experts_and_changes_nothing(models, kind, tmp_path):
    src = models[kind]
    _, model = load_model(src)
    cal = reap.calibrate(model, TOKENS, CONTEXT, "random tokens")
    assert cal.n_windows == 3 and cal.n_tokens == 3 * CONTEXT
    assert (cal.counts.sum(axis=1) == TOP_K * cal.n_tokens).all()
    for i, dead in PLANTED.items():
        assert (cal.counts[i, list(dead)] == 0).all() and (cal.saliency[i, list(dead)] == 0).all()
        assert (cal.counts[i, LIVE[i]] > 0).all() and (cal.saliency[i, LIVE[i]] > 0).all()
    for criterion in ("reap", "frequency"):
        np.testing.assert_array_equal(reap.choose(cal.scores(criterion), LIVE.shape[1]), LIVE)
    dst = tmp_path / "pruned"
    if kind == "fermijit":
        prune.prune_fermijit(src, dst, LIVE, {"criterion": "reap"})
    else:
        prune.prune_hf(src, dst, LIVE, {"criterion": "reap"})
    assert load_model(dst)[1].n_experts == LIVE.shape[1]
    assert_rel("pruned logits", outputs(src), outputs(dst), PRUNED_VS_FULL)


def layer_inputs(model, tokens, context):
    """Each layer's MoE input over reap.calibrate's windows, captured by an observer of our own."""
    index = {id(w): i for i, w in enumerate(model.layers)}
    seen = [[] for _ in model.layers]
    model.moe_observer = lambda layer, x, ids, weights: seen[index[id(layer)]].append(x.copy())
    for s in reap.windows(tokens.size, context):
        model.prefill(tokens[s:s + context], model.new_state(context))
    model.moe_observer = None
    return [np.concatenate(xs) for xs in seen]


@pytest.mark.parametrize("kind, rel", [("hf-fused", FP32_SALIENCY_REL),
                                       ("fermijit", W4A8_SALIENCY_REL)])
def test_saliency_is_the_numpy_reference(models, kind, rel):
    src = models[kind]
    _, model = load_model(src)
    cal = reap.calibrate(model, TOKENS, CONTEXT, "random tokens")
    if kind == "fermijit":
        weights = as_w4a8(convert.load_converted(src)[1])
    else:
        cfg = load_model(src)[0]
        weights = load_text_weights(cfg.text_config, Checkpoint(src))
    for i, x in enumerate(layer_inputs(model, TOKENS, CONTEXT)):
        mlp = weights.layers[i].mlp
        counts, saliency = reap.reference(x, np.asarray(mlp.gate), mlp.experts_gate_up,
                                          mlp.experts_down, TOP_K)
        np.testing.assert_array_equal(cal.counts[i], counts, f"layer {i} counts")
        assert_rel(f"layer {i} saliency", saliency, cal.saliency[i], rel)


def test_choose_keeps_the_highest_scores_in_expert_order():
    scores = np.array([[0.5, 0.1, 0.9, 0.5, 0.0], [1, 2, 3, 4, 5]], np.float64)
    np.testing.assert_array_equal(reap.choose(scores, 3), [[0, 2, 3], [2, 3, 4]])
    np.testing.assert_array_equal(reap.choose(scores[:1], 2), [[0, 2]])  # a tie: the lower id
    r = reap.Calibration(np.zeros((2, 5), np.int64), scores, "x", 1, 1, 1)
    np.testing.assert_array_equal(r.scores("random", 3), r.scores("random", 3))
    assert not np.array_equal(r.scores("random", 3), r.scores("random", 4))


def test_dropped_share_and_layer_spread():
    counts = np.array([[4, 0, 4, 0], [1, 1, 1, 1], [0, 0, 0, 8]], np.int64)
    # kept [0, 2] loses nothing of layer 0, half of layer 1, all of layer 2's
    assert reap.dropped_share(counts, np.array([[0, 2], [0, 1], [0, 1]])) == pytest.approx(0.5)
    saliency = np.array([[2.0, 0, 1, 0], [1, 1, 1, 1], [0, 0, 0, 3]])
    spread = reap.layer_spread(reap.Calibration(counts, saliency, "x", 8, 1, 8))
    assert [round(r["effective_experts"], 9) for r in spread] == [2, 4, 1]  # exp(entropy)
    assert spread[1]["saliency_cv"] == 0 and spread[0]["saliency_cv"] == pytest.approx(
        np.std([2, 0, 1, 0]) / 0.75)
    # ranks with ties averaged: saliency [2, 0, 1, 0] vs counts [4, 0, 4, 0]
    assert spread[0]["rank_corr"] == pytest.approx(np.corrcoef([3, 0.5, 2, 0.5],
                                                               [2.5, 0.5, 2.5, 0.5])[0, 1])
    assert spread[1]["rank_corr"] == 0 and spread[2]["rank_corr"] == pytest.approx(1)


def test_windows_are_whole_and_spread_over_the_text():
    np.testing.assert_array_equal(reap.windows(100, 10), np.arange(10) * 10)
    np.testing.assert_array_equal(reap.windows(105, 10, max_tokens=30), [0, 40, 90])
    assert reap.keep_for_ratio(0.5, 256, 8) == 128 and reap.keep_for_ratio(0.25, 16, 2) == 12
    assert reap.window_length(32, None) == reap.window_length(32, 40) == 32
    assert reap.window_length(32, 20) == 20


def test_max_tokens_under_a_window_calibrates_on_one_shorter_window(models, tmp_path,
                                                                     monkeypatch, capsys):
    """--max-tokens says "at most", but a whole --ctx window was kept: --max-tokens 64 of the
    default 512-token window calibrated on 512 tokens."""
    code, _, err = run_cli(monkeypatch, capsys, "prune", models["fermijit"], tmp_path / "pruned",
                           "--text", calibration_text(tmp_path), "--keep", 6, "--ctx", CONTEXT,
                           "--max-tokens", 20)
    assert code == 0, err
    calibration = json.loads((tmp_path / "pruned" / convert.MANIFEST).read_text())["reap"][
        "calibration"]
    assert (calibration["n_tokens"], calibration["n_windows"], calibration["context"]) == (20, 1,
                                                                                          20)
    assert "calibrated on 20 tokens" in err.splitlines()[-1]


def calibration_text(tmp_path, n_sentences=160):
    path = tmp_path / "calibration.txt"
    path.write_text(" ".join((tiny.CORPUS * 8)[:n_sentences]))
    return path


def test_cli_prunes_a_fermijit_model_with_its_record(models, tmp_path, monkeypatch, capsys):
    src, dst = models["fermijit"], tmp_path / "pruned"
    code, _, err = run_cli(monkeypatch, capsys, "prune", src, dst, "--text",
                        calibration_text(tmp_path), "--ratio", "0.25", "--ctx", CONTEXT,
                        "--max-tokens", 4 * CONTEXT)
    assert code == 0, err
    manifest = json.loads((dst / convert.MANIFEST).read_text())
    record = manifest["reap"]
    assert record["criterion"] == "reap" and record["keep"] == 6 and record["n_experts"] == 8
    np.testing.assert_array_equal(record["kept"], LIVE)
    assert record["calibration"]["source"].endswith("calibration.txt")
    assert record["calibration"]["n_tokens"] == record["calibration"]["n_windows"] * CONTEXT > 0
    assert np.array(record["saliency"]).shape == np.array(record["counts"]).shape == (4, 8)
    text = json.loads((dst / "config.json").read_text())["text_config"]
    assert text["num_experts"] == 6 and text["mtp_num_hidden_layers"] == 0
    before = safetensors.numpy.load_file(src / convert.WEIGHTS)
    after = safetensors.numpy.load_file(dst / convert.WEIGHTS)
    assert set(before) == set(after)
    for name, a in after.items():
        if any(f".mlp.{f}" in name for f in prune.EXPERT_FIELDS):
            layer = int(name.split(".")[1])
            np.testing.assert_array_equal(a, before[name][LIVE[layer]], name)
        else:
            np.testing.assert_array_equal(a, before[name], name)
    assert (dst / convert.WEIGHTS).stat().st_size < (src / convert.WEIGHTS).stat().st_size


def test_a_pruned_hf_checkpoint_converts_to_the_pruned_fermijit_model(models, tmp_path):
    kept = np.array([[0, 2, 3], [1, 5, 7], [2, 4, 6], [0, 1, 7]])
    prune.prune_hf(models["hf-split"], tmp_path / "hf", kept, {"criterion": "random"})
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ckpt = Checkpoint(tmp_path / "hf")
    assert not any(n.startswith("mtp.") for n in ckpt.names())
    assert "model.language_model.layers.1.mlp.experts.2.down_proj.weight" in ckpt
    assert "model.language_model.layers.1.mlp.experts.3.down_proj.weight" not in ckpt
    manifest = convert.convert(tmp_path / "hf", tmp_path / "converted", show_progress=False)
    assert manifest.reap["criterion"] == "random" and manifest.reap["kept"] == kept.tolist()
    prune.prune_fermijit(models["fermijit"], tmp_path / "direct", kept, {"criterion": "random"})
    a = safetensors.numpy.load_file(tmp_path / "converted" / convert.WEIGHTS)
    b = safetensors.numpy.load_file(tmp_path / "direct" / convert.WEIGHTS)
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], name)


@pytest.mark.parametrize("args, message", [
    (["--keep", "9"], "--keep must be between the 2 experts each token uses"),
    (["--keep", "1"], "--keep must be between the 2 experts each token uses"),
    (["--ratio", "1"], "--ratio is the fraction of experts pruned"),
    # It named --keep ("--keep must be between ... got 0"), a flag not given.
    (["--ratio", "0.99"], "--ratio is the fraction of experts pruned, from 0 (keep all 8) to "
                          "0.75 (keep the 2 each token uses, num_experts_per_tok), got 0.99"),
    (["--keep", "4", "--ratio", "0.5"], "give one of --keep and --ratio"),
    ([], "give one of --keep and --ratio"),
    (["--keep", "4", "--ctx", "256"], "fewer than one window of 256"),
    (["--keep", "4", "--ctx", "257"], "--ctx must be between 1 and 256"),
])
def test_bad_arguments_are_one_line(models, tmp_path, monkeypatch, capsys, args, message):
    dst = tmp_path / "pruned"
    code, _, err = run_cli(monkeypatch, capsys, "prune", models["fermijit"], dst, "--text",
                        calibration_text(tmp_path, n_sentences=1), *args)
    assert code == 2 and err.startswith("Error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not dst.exists()


def test_refuses_a_non_empty_output_and_a_mismatched_calibration_model(models, tmp_path,
                                                                     monkeypatch, capsys):
    text = calibration_text(tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    code, _, err = run_cli(monkeypatch, capsys, "prune", models["fermijit"], tmp_path / "full",
                        "--text", text, "--keep", "4")
    assert code == 2 and "exists and is not empty" in err and err.count("\n") == 1
    other = tiny.write_checkpoint(tmp_path / "other", model=tiny.HF_INIT)
    code, _, err = run_cli(monkeypatch, capsys, "prune", models["fermijit"], tmp_path / "out",
                        "--text", text, "--keep", "4", "--calibrate-with", other)
    assert code == 2 and "experts" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["hf-fused", "hf-split"])
def test_transformers_runs_the_pruned_hf_checkpoint_unchanged(models, kind, tmp_path):
    """The pruned HF checkpoint is one transformers loads (config, names, shapes) and its
    outputs are the full model's: the planted experts were never routed."""
    from tests.model import oracle
    if not oracle.has_transformers():
        pytest.skip("torch and transformers >= 5.24 are not importable")
    prune.prune_hf(models[kind], tmp_path / "pruned", LIVE, {"criterion": "reap"})
    full, pruned = oracle.live(models[kind]), oracle.live(tmp_path / "pruned")
    assert_rel("prompt logits", full.prompt_logits, pruned.prompt_logits, PRUNED_VS_FULL_TORCH)
    np.testing.assert_array_equal(full.tokens, pruned.tokens)


def test_kept_ids_are_checked(models, tmp_path):
    for kept in (LIVE[:3], LIVE[:, ::-1], LIVE[:, :1], LIVE + 2):
        with pytest.raises(FermijitError, match="kept experts must be"):
            prune.prune_fermijit(models["fermijit"], tmp_path / "x", kept, {})
        with pytest.raises(FermijitError, match="kept experts must be"):
            prune.prune_hf(models["hf-fused"], tmp_path / "y", kept, {})
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_calibration_through_a_gpu_prefiller_without_a_gpu_is_the_cpus(models, monkeypatch):
    """Issue 15 item 1: where the GPU prefill cannot run, calibration falls back to the CPU
    forward (one line on stderr) and counts every token once; the GPU runs themselves:
    tests/model/test_reap_gpu.py."""
    import io

    from fermijit.jit import gpu
    from fermijit.prefill import hybrid

    monkeypatch.setattr(gpu, "unavailable_reason", lambda: "pycuda is not installed (test)")
    _, model = load_model(models["fermijit"])
    cpu = reap.calibrate(model, TOKENS, CONTEXT, "random tokens")
    for mode in ("gpu", "auto"):
        err = io.StringIO()
        cal = reap.calibrate(model, TOKENS, CONTEXT, "random tokens",
                             prefiller=hybrid.make(model, mode, err=err))
        np.testing.assert_array_equal(cal.counts, cpu.counts)
        np.testing.assert_array_equal(cal.saliency, cpu.saliency)
        lines = err.getvalue().splitlines()
        if mode == "gpu":  # said once; auto is quiet without a GPU (its ordinary case)
            assert len(lines) == 1 and "prefilling on the CPU" in lines[0], lines
        else:
            assert lines == []


def test_cli_prune_with_gpu_prefill_falls_back_on_one_line(models, tmp_path, monkeypatch, capsys):
    from fermijit.jit import gpu

    monkeypatch.setattr(gpu, "unavailable_reason", lambda: "pycuda is not installed (test)")
    code, _, err = run_cli(monkeypatch, capsys, "prune", models["fermijit"], tmp_path / "p",
                           "--text", calibration_text(tmp_path), "--keep", 6, "--ctx", CONTEXT,
                           "--max-tokens", 2 * CONTEXT, "--prefill", "gpu")
    assert code == 0, err
    assert err.count("prefilling on the CPU") == 1, err
    record = json.loads((tmp_path / "p" / convert.MANIFEST).read_text())["reap"]
    np.testing.assert_array_equal(record["kept"], LIVE)
    code, _, err = run_cli(monkeypatch, capsys, "prune", models["fermijit"], tmp_path / "q",
                           "--text", calibration_text(tmp_path), "--keep", 6, "--prefill", "gpu",
                           "--gpu-mem", "lots")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
