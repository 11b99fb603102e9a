"""Issue 11 through the command line, as a hostile user would try it: every bad input or bad
environment is one line on stderr and exit 2; nothing diagnostic reaches stdout. Subprocesses
where the case is about the process (closed streams, argv bytes, the Numba cache), in-process
otherwise (a subprocess costs ~1 s here)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from fermijit.engine import DEFAULT_MODEL
from tests.cli import run_cli

GREEDY = ("--max-tokens", "6", "--temperature", "0", "--threads", "1")


def fermijit(*args, stdin: bytes | None = None, env=None, preexec_fn=None, stdout=None):
    r = subprocess.run([sys.executable, "-m", "fermijit", *args], input=stdin,
                       stdout=subprocess.PIPE if stdout is None else stdout,
                       stderr=subprocess.PIPE, timeout=300, env=env, preexec_fn=preexec_fn)
    return r.returncode, r.stdout or b"", r.stderr.decode("utf-8", "replace")


def assert_one_line(code, err, message):
    """Exit 2, and the error is the last line of stderr, the only one (progress may precede)."""
    assert code == 2, (code, err)
    lines = err.splitlines()
    assert "Traceback" not in err and [x for x in lines if x.startswith("Error")] == lines[-1:], err
    assert message in lines[-1], err


def test_closed_stderr_keeps_stdout_the_generated_text():
    """Case 2: with fd 2 closed, the "loaded"/"kernels ready"/summary lines went to stdout."""
    code, out, _ = fermijit("generate", "def f", *GREEDY)
    assert code == 0
    code, closed_out, _ = fermijit("generate", "def f", *GREEDY, preexec_fn=lambda: os.close(2))
    assert code == 0 and closed_out == out
    assert b"loaded" not in closed_out and b"kernels ready" not in closed_out


def test_stdout_full_is_one_line():
    """Case 8: stdout on /dev/full (every write ENOSPC)."""
    with open("/dev/full", "wb") as full:
        code, _, err = fermijit("generate", "def f", *GREEDY, stdout=full)
    assert_one_line(code, err, "cannot write the generated text: No space left on device")


def test_closed_stdout_is_not_a_traceback():
    """Case 8: with fd 1 closed, sys.stdout is None (AttributeError); the text goes nowhere, as
    asked."""
    code, _, err = fermijit("generate", "def f", *GREEDY, preexec_fn=lambda: os.close(1))
    assert code == 0 and "Traceback" not in err and "generated 6 tokens" in err, err


def test_invalid_utf8_prompts_are_one_line():
    """Case 6: argv bytes and stdin bytes that are not UTF-8."""
    r = subprocess.run([sys.executable.encode(), b"-m", b"fermijit", b"generate", b"\xff\xfe"],
                       capture_output=True, timeout=300)
    assert_one_line(r.returncode, r.stderr.decode(), "the prompt: not valid UTF-8")
    code, _, err = fermijit("generate", stdin=b"abc\xff")
    assert_one_line(code, err, "standard input: not UTF-8 text")


def test_endless_stdin_and_text_are_capped(monkeypatch, capsys):
    """Case 12: `generate < /dev/zero` and `eval --text /dev/zero` read until MemoryError."""
    with open("/dev/zero", "rb") as zero:
        r = subprocess.run([sys.executable, "-m", "fermijit", "generate"], stdin=zero,
                           capture_output=True, timeout=300)
    assert_one_line(r.returncode, r.stderr.decode(), "standard input: larger than 64 MiB")
    code, out, err = run_cli(monkeypatch, capsys, "eval", "--text", "/dev/zero")
    assert out == ""
    assert_one_line(code, err, "/dev/zero: larger than 64 MiB")


def test_huge_top_k_is_clamped(tmp_path, monkeypatch, capsys):
    """Case 6: --top-k 2**64 and generation_config top_k 1e30 overflowed Numba's int64."""
    code, out, err = run_cli(monkeypatch, capsys, "generate", "def f", "--top-k", 2 ** 64,
                             "--max-tokens", 3, "--threads", 1)
    assert code == 0, err
    model = tmp_path / "m"
    shutil.copytree(DEFAULT_MODEL, model)
    gen = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**gen, "top_k": 1e30}))
    code, out, err = run_cli(monkeypatch, capsys, "generate", "--model", model, "def f",
                             "--max-tokens", 3, "--threads", 1)
    assert code == 0, err


@pytest.mark.parametrize("speculative", ["none", "mtp"])
def test_a_subnormal_temperature_is_greedy(monkeypatch, capsys, speculative):
    """--temperature 5e-324 (or a request's): logits / T overflowed to inf, and inf - inf made
    every probability NaN: the sampler took the least likely token ("ragx how C APIs" against
    greedy's "ash The `fractions"). T -> 0 is greedy."""
    texts = []
    for temperature in (0, 5e-324):
        code, out, err = run_cli(monkeypatch, capsys, "generate", "def f", "--max-tokens", 6,
                                 "--threads", 1, "--temperature", temperature,
                                 "--speculative", speculative)
        assert code == 0 and "RuntimeWarning" not in err, err
        texts.append(out)
    assert texts[0] == texts[1]


@pytest.mark.parametrize("gib, message", [("nan", "--gib must be a finite number"),
                                          ("100000", "--gib 100000 needs about")])
def test_bench_gib_beyond_reason(monkeypatch, capsys, gib, message):
    """Case 6: ValueError / OSError."""
    code, out, err = run_cli(monkeypatch, capsys, "bench", "kernels", "--gib", gib)
    assert_one_line(code, err, message)


@pytest.mark.parametrize("flag, size, message", [
    ("--cache-mem", "inf", "'inf' is not a size such as 512M or 2G"),
    ("--cache-mem", "1e300T", "'1e300T' is not a size"),
    ("--gpu-mem", "9" * 400, "not a size: '999"),
    ("--pin-budget", "9" * 400 + "G", "not a size: '999"),
])
def test_a_size_past_a_float_is_one_line(monkeypatch, capsys, flag, size, message):
    """--cache-mem inf, --kv-mem 1e400, --gpu-mem of 400 digits: int(inf) raised OverflowError,
    a traceback."""
    code, out, err = run_cli(monkeypatch, capsys, "generate", "def f", flag, size,
                             "--max-tokens", 1, "--threads", 1)
    assert_one_line(code, err, message)


@pytest.mark.parametrize("file, change, message", [
    ("config.json", lambda r: r.update(rms_norm_eps=float("nan")), "NaN is not"),
    ("config.json", lambda r: r.update(num_hidden_layers=10 ** 9, layer_types=None) or
     r.pop("layer_types"), "num_hidden_layers 1000000000 is beyond"),
    ("generation_config.json", lambda r: r.update(top_k=float("inf")), "Infinity is not"),
    ("tokenizer_config.json", lambda r: r.update(chat_template="{{ 1/0 }}"),
     "chat template: ZeroDivisionError"),
    ("tokenizer_config.json", lambda r: r.update(
        chat_template="{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                      "{% endfor %}"), "chat template: rendering took more than 2 s"),
    ("fermijit.json", lambda r: r.update(weights="/etc/passwd"), "is not a bare file name"),
])
def test_bad_model_files_are_one_line(tmp_path, monkeypatch, capsys, file, change, message):
    """Cases 1, 3, 10, 11, 13 through `generate --chat`."""
    model = tmp_path / "m"
    shutil.copytree(DEFAULT_MODEL, model)
    raw = json.loads((model / file).read_text())
    change(raw)
    (model / file).write_text(json.dumps(raw))  # Python writes NaN/Infinity literals
    code, out, err = run_cli(monkeypatch, capsys, "generate", "--model", model, "--chat", "hi",
                             "--max-tokens", 2, "--threads", 1)
    assert out == ""
    assert_one_line(code, err, message)


def test_context_beyond_memory_is_one_line(tmp_path, monkeypatch, capsys):
    """Case 7: a --ctx the config allows but memory does not: said before allocating (the
    positions it will use: memory for a whole --ctx is taken only as it is used)."""
    from fermijit.engine import DEFAULT_MODEL
    from fermijit.model import state
    from fermijit.model.forward import load_model

    nbytes = load_model(DEFAULT_MODEL)[1].state_nbytes(256)
    monkeypatch.setattr(state, "available_nbytes", lambda: nbytes - 1)  # the warm-up's fits
    code, out, err = run_cli(monkeypatch, capsys, "generate", "def f", "--ctx", 256,
                             "--threads", 1)
    assert out == ""
    assert_one_line(code, err, "a context of 256 tokens needs")
    assert "GiB of memory is available" in err


NO_LOCATOR = textwrap.dedent("""
    import sys
    import numba.core.caching as caching
    # A read-only install without a writable HOME: Numba finds no place for its cache.
    caching.CacheImpl._locator_classes = [{}]
    from fermijit.jit.cpu import kernel

    @kernel
    def add_one(x):
        return x + 1

    print(add_one(41))
""")


@pytest.mark.parametrize("locators, said", [
    ("caching.UserProvidedCacheLocator", "kernels are cached in {tmp}/fermijit-"),
    ("", "no writable folder for Numba's cache: kernels are compiled on every run"),
])
def test_no_numba_cache_locator_falls_back(tmp_path, locators, said):
    """Case 5: every model command tracebacked at import."""
    env = {k: v for k, v in os.environ.items() if k not in ("HOME", "NUMBA_CACHE_DIR")}
    env.update(TMPDIR=str(tmp_path), XDG_CACHE_HOME="/dev/null/cache")
    script = tmp_path / "no_locator.py"  # a file: Numba caches only functions that have one
    script.write_text(NO_LOCATOR.format(locators))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0 and r.stdout == "42\n", r.stderr
    assert r.stderr.count("\n") == 1 and said.format(tmp=tmp_path) in r.stderr, r.stderr


@pytest.mark.parametrize("flags", [("--draft", 3), ("--draft-vocab", 100)])
def test_drafts_without_speculative_decoding_are_a_usage_error(monkeypatch, capsys, flags):
    """--draft / --draft-vocab with --speculative none asked for drafts that were never made
    (silently ignored)."""
    code, out, err = run_cli(monkeypatch, capsys, "generate", "def f", *GREEDY, *flags)
    assert_one_line(code, err, "--draft and --draft-vocab need --speculative mtp")


def test_a_speculative_run_without_drafts_says_so(monkeypatch, capsys):
    """A speculative run that made no draft (one token to generate: no step) printed "nan% of
    0 drafts accepted"."""
    code, out, err = run_cli(monkeypatch, capsys, "generate", "def f", "--max-tokens", 1,
                             "--threads", 1, "--temperature", 0, "--speculative", "mtp")
    assert code == 0 and "no drafts made" in err and "nan" not in err, err
