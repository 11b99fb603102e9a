"""The third adversarial sweep of the command line and the files it reads and writes: each case a
defect found by the sweep (a traceback, a lost file, a partial output left looking valid, a
setting silently ignored), now one line on stderr and exit 2, or refused before harm."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys

import pytest

from fermijit import FermijitError
from fermijit.engine import DEFAULT_MODEL
from tests.cli import run_cli
from tests.fermijit.test_hardening import assert_one_line

pytest.importorskip("gguf")


@pytest.fixture
def model(tmp_path):
    """A copy of the embedded model, free to damage."""
    shutil.copytree(DEFAULT_MODEL, tmp_path / "m")
    return tmp_path / "m"


def test_export_onto_its_own_weights_file_is_refused(model, monkeypatch, capsys):
    """`export M M/model.safetensors` truncated the model's own weights before reading them:
    the model was lost, and the error was numpy's "20480 requested and 0 written"."""
    weights = model / "model.safetensors"
    before = weights.read_bytes()
    code, _, err = run_cli(monkeypatch, capsys, "export", model, weights)
    assert_one_line(code, err, "is a file of the model")
    assert weights.read_bytes() == before
    code, _, err = run_cli(monkeypatch, capsys, "export", model, model / "fermijit.json")
    assert_one_line(code, err, "is a file of the model")


def test_a_failed_export_leaves_no_file(model, tmp_path, monkeypatch, capsys):
    """A disk that filled (or a kill) mid-export left DST with a whole header and part of the
    data: a file that looks like a GGUF. Now it is written beside DST and renamed when whole;
    the old DST stays as it was."""
    from gguf import GGUFWriter

    dst = tmp_path / "out.gguf"
    dst.write_bytes(b"an older export")
    calls = []

    def full_disk(self, tensor):
        calls.append(1)
        if len(calls) > 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return write(self, tensor)

    write = GGUFWriter.write_tensor_data
    monkeypatch.setattr(GGUFWriter, "write_tensor_data", full_disk)
    code, _, err = run_cli(monkeypatch, capsys, "export", model, dst)
    assert_one_line(code, err, "No space left on device")
    assert dst.read_bytes() == b"an older export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "out.gguf"]
    monkeypatch.setattr(GGUFWriter, "write_tensor_data", write)
    code, _, err = run_cli(monkeypatch, capsys, "export", model, dst)
    assert code == 0, err
    assert dst.read_bytes()[:4] == b"GGUF"


def fermijit_env(env: dict, *args):
    """`python -m fermijit ARGS` in a fresh process under `env` added to this one's: (exit code,
    stderr). Numba reads its environment when it is first imported."""
    r = subprocess.run([sys.executable, "-m", "fermijit", *map(str, args)], capture_output=True,
                       timeout=300, env={**os.environ, **env})
    return r.returncode, r.stderr.decode("utf-8", "replace")


GREEDY = ("generate", "def f", "--max-tokens", 2, "--temperature", 0)


@pytest.mark.parametrize("env, message", [
    # Numba raised ValueError as it was imported: "Number of threads specified must be > 0."
    ({"NUMBA_NUM_THREADS": "0"}, "NUMBA_NUM_THREADS must be a whole number of threads >= 1"),
    ({"NUMBA_NUM_THREADS": "-3"}, "NUMBA_NUM_THREADS must be a whole number of threads >= 1"),
    # Numba warned (a traceback's text) and took its default.
    ({"NUMBA_NUM_THREADS": "two"}, "NUMBA_NUM_THREADS must be a whole number of threads >= 1"),
    # ValueError as the threads started: the layer unknown, or TBB not installed.
    ({"NUMBA_THREADING_LAYER": "garbage"},
     "Numba's threads: The threading layer requested 'garbage' is unknown to Numba."),
    # No variant supported: StopIteration from select_isa's next().
    ({"NUMBA_CPU_FEATURES": "+sse2"}, "lacks ssse3"),
])
def test_numba_settings_numba_refuses_are_one_line(env, message):
    code, err = fermijit_env(env, *GREEDY, "--threads", 1)
    assert_one_line(code, err, message)


@pytest.mark.parametrize("name, value, message", [
    # ValueError from float(): a traceback.
    ("FERMIJIT_POPULATE_CHUNK", "lots",
     "FERMIJIT_POPULATE_CHUNK must be a number >= 0, got 'lots'"),
    # ValueError from int() on the populate's own thread: its traceback, then the run went on.
    ("FERMIJIT_POPULATE_NICE", "low",
     "FERMIJIT_POPULATE_NICE must be a whole number >= -20, got 'low'"),
    # Taken as 0 (no helpers) without a word.
    ("FERMIJIT_COMPILE_WORKERS", "many", "FERMIJIT_COMPILE_WORKERS must be a whole number >= 0"),
    ("FERMIJIT_CLAIMS_FROM_TEAM", "x", "FERMIJIT_CLAIMS_FROM_TEAM must be a whole number >= 0"),
])
def test_a_tuning_variable_set_to_garbage_is_one_line(name, value, message):
    code, err = fermijit_env({name: value}, *GREEDY, "--threads", 1)
    assert_one_line(code, err, message)


def test_env_number():
    from fermijit import env_number

    assert env_number("FERMIJIT_TEST_UNSET", 7) == 7
    with pytest.MonkeyPatch.context() as m:
        for text, kind, expected in (("3", int, 3), (" 0.5 ", float, 0.5), ("", int, 7)):
            m.setenv("FERMIJIT_TEST_N", text)
            assert env_number("FERMIJIT_TEST_N", 7, kind) == expected
        for text in ("nan", "inf", "-1", "1e999", "x"):
            m.setenv("FERMIJIT_TEST_N", text)
            with pytest.raises(FermijitError, match="FERMIJIT_TEST_N must be a number >= 0"):
                env_number("FERMIJIT_TEST_N", 1.0, float)


def test_the_start_switch_interval_is_one_line(monkeypatch):
    """serve's FERMIJIT_START_SWITCH_S: float('x') and sys.setswitchinterval(-1) raised."""
    from fermijit.server import run

    for text in ("x", "-1", "nan"):
        monkeypatch.setenv(run.START_SWITCH_ENV, text)
        with pytest.raises(FermijitError, match="FERMIJIT_START_SWITCH_S must be a number >= 0"):
            with run.start_switch_interval():
                pass


def test_a_config_without_the_attention_gate_is_refused(model, monkeypatch, capsys):
    """attn_output_gate false was read and ignored: the code always gates (a q_proj of twice
    the heads' rows read as queries and gates), as attention_bias true is refused."""
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attn_output_gate": False}))
    code, out, err = run_cli(monkeypatch, capsys, "generate", "--model", model, "def f",
                             "--max-tokens", 2, "--threads", 1)
    assert out == ""
    assert_one_line(code, err, "attn_output_gate false is not supported")


@pytest.mark.parametrize("field, value, message", [
    ("temperature", "hot", "temperature must be a number, got 'hot'"),  # was the default 1.0
    ("top_p", "0.5", "top_p must be a number, got '0.5'"),              # was the default 1.0
    ("top_k", "5", "top_k must be a whole number, got '5'"),            # was the default 50
    ("top_k", 0.5, "top_k must be a whole number, got 0.5"),            # int(): 0, "all"
    ("do_sample", "no", "do_sample must be true or false, got 'no'"),   # sampled
])
def test_generation_config_values_of_the_wrong_kind_are_one_line(model, monkeypatch, capsys,
                                                                 field, value, message):
    """A value of generation_config.json that is not a number (or do_sample not a boolean) was
    passed over for the default, without a word."""
    path = model / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    code, out, err = run_cli(monkeypatch, capsys, "generate", "--model", model, "def f",
                             "--max-tokens", 2, "--threads", 1)
    assert out == ""
    assert_one_line(code, err, f"generation_config.json: {message}")


def set_text_config(model, **fields):
    """config.json of `model` with `fields` set in its text config."""
    config = json.loads((model / "config.json").read_text())
    config.get("text_config", config).update(fields)
    (model / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("layers", [3, 2, -1])
def test_an_mtp_of_other_than_0_or_1_layers_is_refused(model, monkeypatch, capsys, layers):
    """mtp_num_hidden_layers 3 was read and ignored: the one stored layer ran as the head."""
    set_text_config(model, mtp_num_hidden_layers=layers)
    code, out, err = run_cli(monkeypatch, capsys, *GREEDY, "--model", model, "--threads", 1)
    assert out == ""
    assert_one_line(code, err, f"mtp_num_hidden_layers {layers} is not supported (0 or 1)")


def test_an_mtp_of_0_layers_leaves_the_stored_head_unused(model, monkeypatch, capsys):
    """mtp_num_hidden_layers 0 with the head's mtp.* tensors stored: the head ran anyway (an HF
    checkpoint's, and a GGUF's, is left out, as transformers leaves it). Now 0 is no head for a
    fermijit model too: the model runs without it, `--speculative mtp` says so, and a pruned
    copy drops it."""
    from fermijit.model import forward

    set_text_config(model, mtp_num_hidden_layers=0)
    code, out, err = run_cli(monkeypatch, capsys, *GREEDY, "--model", model, "--threads", 1)
    assert code == 0 and out, err
    code, out, err = run_cli(monkeypatch, capsys, *GREEDY, "--model", model, "--threads", 1,
                             "--speculative", "mtp")
    assert out == ""
    assert_one_line(code, err, "has no MTP head (config.json's mtp_num_hidden_layers is 0)")
    assert forward.load_model(model)[1].mtp is None
    text = model.parent / "calibration.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 40)
    code, _, err = run_cli(monkeypatch, capsys, "prune", model, model.parent / "pruned",
                           "--text", text, "--keep", 8, "--ctx", 64, "--max-tokens", 64,
                           "--threads", 1)
    assert code == 0, err
    manifest = json.loads((model.parent / "pruned" / "fermijit.json").read_text())
    assert not any(name.startswith("mtp.") for name in manifest["tensors"])
    assert forward.load_model(model.parent / "pruned")[1].mtp is None


@pytest.mark.parametrize("command", [
    (*GREEDY, "--model", "{m}"),                # were "missing tensor model.language_model..."
    ("eval", "--model", "{m}", "--text", "{m}/config.json"),
    ("convert", "{m}", "{m}-converted"),
    ("export", "{m}", "{m}.gguf"),              # were "not a fermijit model (no fermijit.json;
    ("verify", "--model", "{m}"),               # convert it first)"
])
def test_a_model_without_its_manifest_is_said_unfinished(model, monkeypatch, capsys, command):
    """A conversion killed between writing the weights and the manifest (written last) left a
    directory read as an HF checkpoint, which failed on a tensor name."""
    (model / "fermijit.json").unlink()
    code, out, err = run_cli(monkeypatch, capsys, *(a.format(m=model) for a in map(str, command)))
    assert out == ""
    assert_one_line(code, err, f"{model} holds fermijit-converted weights (model.safetensors "
                               f"with fermijit tensor names) but no fermijit.json: an unfinished "
                               f"conversion? remove it and convert again")


def test_converting_a_fermijit_model_is_refused(model, monkeypatch, capsys):
    """It failed as an HF checkpoint: "missing tensor model.language_model.embed_tokens...\""""
    code, out, err = run_cli(monkeypatch, capsys, "convert", model, model.parent / "again")
    assert_one_line(code, err, f"{model} is a fermijit model already (fermijit.json): nothing "
                               f"to convert")
    assert not (model.parent / "again").exists()


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_at_load(model, monkeypatch, capsys):
    """Ids past the embedding failed only when a text held them ("token ids must be in [0,
    8192)"), after the load; a tokenizer smaller than vocab_size stays allowed (real models pad
    their vocabulary)."""
    path = model / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    tokenizer["added_tokens"].append({"id": 8192, "content": "<|past the embedding|>",
                                      "single_word": False, "lstrip": False, "rstrip": False,
                                      "normalized": False, "special": True})
    path.write_text(json.dumps(tokenizer))
    for command in (GREEDY, ("eval", "--text", model / "config.json")):
        code, out, err = run_cli(monkeypatch, capsys, *command, "--model", model, "--threads", 1)
        assert out == ""
        assert_one_line(code, err, f"{path}: 8193 tokens, more than the model's vocab_size "
                                   f"8192 (config.json): the tokenizer of another model?")
