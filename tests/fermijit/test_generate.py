"""`python -m fermijit generate` (fermijit/engine.py) on the tiny HF_INIT model, 4-bit and fp32:
the streamed text is what the engine's loop generates, the summary is on stderr, and bad input is
one line on stderr with exit code 2 (issue 3, Bad input). Run as subprocesses, as a user would."""

from __future__ import annotations

import json
from pathlib import Path
import shutil
import subprocess
import sys

import numpy as np
import pytest

from fermijit.engine import DEFAULT_MODEL, Settings, Stop, generate, sampling_settings
from fermijit.model import convert
from fermijit.model.forward import load_model
from fermijit.model.safetensors_io import save_file
from fermijit.model.tokenizer import Tokenizer
from fermijit.ops.sampling import Sampler
from tests.model import tiny

PROMPT = "the cat sat on the"
FLAGS = ("--threads", "1")  # CI has 2 shared cores: one Numba thread is the quicker there


def fermijit(*args, stdin: str | None = None):
    r = subprocess.run([sys.executable, "-m", "fermijit", *map(str, args)],
                       input=None if stdin is None else stdin.encode("utf-8"),
                       capture_output=True, timeout=300)
    return r.returncode, r.stdout.decode("utf-8"), r.stderr.decode("utf-8")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    hf = tiny.write_checkpoint(root / "hf", model=tiny.HF_INIT)
    convert.convert(hf, root / "q4", show_progress=False)
    return {"hf": hf, "q4": root / "q4"}


def expected(directory, prompt_text, n_tokens, is_chat=False, **sampling):
    """What the engine's loop makes in-process: (text, tokens)."""
    cfg, model = load_model(directory)
    tok = Tokenizer(directory, cfg.text_config.eos_token_id)
    text = tok.render_chat([{"role": "user", "content": prompt_text}]) if is_chat else prompt_text
    prompt = tok.encode(text, add_special_tokens=not is_chat)
    sampler = Sampler(model.vocab_size, **{"temperature": 0.0, "top_k": 50, "top_p": 1.0,
                                           "seed": 0, **sampling})
    tokens, _ = generate(model, prompt, sampler, n_tokens, 256, tok.eos_ids, lambda t: None)
    return tok.decode(tokens), tokens


@pytest.mark.parametrize("kind", ["q4", "hf"])
def test_greedy_streams_the_continuation(models, kind):
    code, out, err = fermijit("generate", "--model", models[kind], PROMPT, "--max-tokens", 12,
                              "--temperature", 0, *FLAGS)
    assert code == 0, err
    text, tokens = expected(models[kind], PROMPT, 12)
    assert out == text and len(tokens) > 0
    assert "4-bit fermijit" in err if kind == "q4" else "unquantised" in err
    summary = err.strip().splitlines()[-1]
    n_prompt = Tokenizer(models[kind]).encode(PROMPT).size
    for part in (f"prompt {n_prompt} tokens", "prefill", "tok/s", f"generated {len(tokens)} tokens",
                 "decode", "peak RSS", "MiB"):
        assert part in summary, summary


def test_prompt_from_stdin_and_chat(models):
    code, out, err = fermijit("generate", "--model", models["q4"], "--max-tokens", 8,
                              "--temperature", 0, *FLAGS, stdin=PROMPT)
    assert code == 0, err
    assert out == expected(models["q4"], PROMPT, 8)[0]
    code, out, err = fermijit("generate", "--model", models["q4"], PROMPT, "--chat",
                              "--max-tokens", 8, "--temperature", 0, *FLAGS)
    assert code == 0, err
    assert out == expected(models["q4"], PROMPT, 8, is_chat=True)[0]
    chat = "<|im_start|>user\n" + PROMPT + "<|im_end|>\n<|im_start|>assistant\n"
    n_prompt = Tokenizer(models["q4"]).encode(chat, add_special_tokens=False).size
    assert f"prompt {n_prompt} tokens" in err


def test_sampling_is_seeded(models):
    args = ("generate", "--model", models["q4"], PROMPT, "--max-tokens", 10,
            "--temperature", 0.9, "--top-k", 40, "--top-p", 0.95, *FLAGS)
    runs = [fermijit(*args, "--seed", seed) for seed in (7, 7)]
    assert runs[0][0] == 0 and runs[0][1] == runs[1][1]
    assert runs[0][1] == expected(models["q4"], PROMPT, 10, temperature=0.9, top_k=40,
                                  top_p=0.95, seed=7)[0]


def test_loop_stops_at_eos_and_at_the_end_of_the_context(models):
    cfg, model = load_model(models["q4"])
    tok = Tokenizer(models["q4"])
    prompt = tok.encode(PROMPT)
    greedy = Sampler(model.vocab_size, temperature=0, top_k=0, top_p=1, seed=0)
    tokens, stats = generate(model, prompt, greedy, 12, 64, frozenset(), lambda t: None)
    assert stats.stop is Stop.MAX_TOKENS and stats.n_decode_steps == 11
    seen = []
    eos = tokens[5]
    first = tokens.index(eos)  # the first occurrence stops it
    stopped, stats = generate(model, prompt, greedy, 12, 64, frozenset({eos}), seen.append)
    assert stopped == tokens[:first] == seen and stats.stop is Stop.EOS
    context = prompt.size + 3  # the prompt and 3 tokens: 2 decoded + the last sampled
    stopped, stats = generate(model, prompt, greedy, 12, context, frozenset(), lambda t: None)
    assert stopped == tokens[:3] and stats.stop is Stop.CONTEXT


def test_sampling_settings_come_from_flags_then_generation_config():
    gen = {"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert sampling_settings(Settings(), gen) == (0.6, 20, 0.95)
    assert sampling_settings(Settings(temperature=0.3, top_k=0, top_p=1.0), gen) == (0.3, 0, 1.0)
    assert sampling_settings(Settings(), {"do_sample": False, "temperature": 0.6})[0] == 0.0
    assert sampling_settings(Settings(temperature=0.5), {"do_sample": False})[0] == 0.5
    assert sampling_settings(Settings(), {}) == (1.0, 50, 1.0)  # HF's defaults


# --- bad input ----------------------------------------------------------------------------------

def broken_model(models, tmp_path, case):
    """A model directory with one thing wrong; returns it."""
    kind = "q4" if case.startswith("q4-") else "hf"
    d = tmp_path / case
    shutil.copytree(models[kind], d)
    w = tiny.random_weights(model=tiny.HF_INIT)
    name = "model.language_model.layers.1.linear_attn.dt_bias"
    if case == "missing-config":
        (d / "config.json").unlink()
    elif case == "unsupported-type":
        (d / "config.json").write_text(json.dumps({"model_type": "qwen3_next"}))
    elif case == "missing-tensor":
        del w[name]
        save_file(d / "model.safetensors", w)
    elif case == "shape-mismatch":
        w[name] = w[name][:2]
        save_file(d / "model.safetensors", w)
    elif case == "dtype-mismatch":
        w[name] = w[name].astype(np.int32)
        save_file(d / "model.safetensors", w)
    elif case in ("truncated", "q4-truncated"):
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors").write_bytes(data[:len(data) * 2 // 3])
    elif case == "corrupt-header":
        data = bytearray((d / "model.safetensors").read_bytes())
        data[8:12] = b"\xff\xfe{["
        (d / "model.safetensors").write_bytes(bytes(data))
    elif case == "q4-no-tokenizer":
        (d / "tokenizer.json").unlink()
    elif case == "q4-manifest-shape":
        manifest = json.loads((d / convert.MANIFEST).read_text())
        manifest["tensors"]["layers.2.mlp.experts_down"]["shape"] = [16, 128, 32]
        (d / convert.MANIFEST).write_text(json.dumps(manifest))
    return d


MODEL_CASES = {
    "missing-config": "no config file",
    "unsupported-type": "unsupported model_type 'qwen3_next'",
    "missing-tensor": "missing tensor model.language_model.layers.1.linear_attn.dt_bias",
    "shape-mismatch": "tensor model.language_model.layers.1.linear_attn.dt_bias has shape [2], "
                      "expected [4]",
    "dtype-mismatch": "tensor model.language_model.layers.1.linear_attn.dt_bias has dtype I32",
    "truncated": "corrupt safetensors file",
    "corrupt-header": "corrupt safetensors file: header: not UTF-8",
    "q4-truncated": "corrupt safetensors file",
    "q4-no-tokenizer": "no tokenizer.json",
    "q4-manifest-shape": "tensor layers.2.mlp.experts_down has shape [16, 128, 32], config.json "
                         "implies [16, 128, 64]",
}


def assert_one_line_error(code, out, err, message):
    assert code == 2, (code, err)
    assert out == "" and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("Error: ") and message in err, err


@pytest.mark.parametrize("case", MODEL_CASES)
def test_bad_model_is_one_line(models, tmp_path, case):
    d = broken_model(models, tmp_path, case)
    assert_one_line_error(*fermijit("generate", "--model", d, PROMPT, *FLAGS), MODEL_CASES[case])


def test_missing_directory_is_one_line(tmp_path):
    assert_one_line_error(*fermijit("generate", "--model", tmp_path / "nowhere", PROMPT),
                          "no such model directory")


LONG = "the cat sat on the mat " * 60  # ~300 tokens: past max_position_embeddings (256)

PROMPT_CASES = {
    "past --ctx": (("--ctx", 3), PROMPT, "tokens, and at least 1 to generate: more than the "
                                         "context of 3 (--ctx)"),
    "past the model": ((), LONG, "more than the context of 256 (max_position_embeddings)"),
    "ctx past the model": (("--ctx", 1000), PROMPT, "--ctx must be between 1 and 256"),
    "empty": ((), "", "the prompt is empty"),
}


@pytest.mark.parametrize("case", PROMPT_CASES)
def test_bad_prompt_is_one_line(models, case):
    flags, prompt, message = PROMPT_CASES[case]
    assert_one_line_error(*fermijit("generate", "--model", models["q4"], *flags, *FLAGS,
                                    stdin=prompt), message)


def test_generate_and_the_server_share_one_context_rule(models):
    """The context holds the prompt and the tokens generated after it, and at least one must fit
    (engine.fits): `generate` ran a prompt that filled --ctx (its one token past the context,
    never fed), which the server refused at the model's context; it stops where the two fill
    the context, as the server's max_tokens bound does."""
    from fermijit.server.prompts import check_context
    from fermijit.server.protocol import ApiError, Job

    n_prompt = Tokenizer(models["q4"]).encode(PROMPT).size
    assert_one_line_error(*fermijit("generate", "--model", models["q4"], PROMPT, "--ctx",
                                    n_prompt, *FLAGS),
                          f"the prompt has {n_prompt} tokens, and at least 1 to generate: more "
                          f"than the context of {n_prompt} (--ctx)")
    assert len(expected(models["q4"], PROMPT, 3)[1]) == 3  # no end-of-sequence id among them
    code, _, err = fermijit("generate", "--model", models["q4"], PROMPT, "--ctx", n_prompt + 2,
                            "--temperature", 0, *FLAGS)
    assert code == 0 and "generated 2 tokens" in err and "(context full)" in err, err

    def server(max_tokens, context):
        job = Job(is_chat=False, prompt="", max_tokens=max_tokens, temperature=0, top_p=None,
                  top_k=None, seed=0, stop=(), stream=False, include_usage=False)
        check_context(n_prompt, job, context)

    for max_tokens in (None, 1):
        with pytest.raises(ApiError, match=f"maximum context length is {n_prompt} tokens; the "
                                           f"prompt has {n_prompt} plus (at least )?1 to "
                                           f"generate"):
            server(max_tokens, n_prompt)
    server(2, n_prompt + 2)
    with pytest.raises(ApiError):
        server(3, n_prompt + 2)


FLAG_CASES = {
    "temperature<0": (("--temperature", -1), "--temperature"),
    "temperature nan": (("--temperature", "nan"), "temperature must be a finite number"),
    "temperature abc": (("--temperature", "abc"), "'abc' is not a valid float"),
    "top-p 0": (("--top-p", 0), "--top-p"),
    "top-p > 1": (("--top-p", 1.5), "--top-p"),
    "top-k < 0": (("--top-k", -1), "--top-k"),
    "max-tokens 0": (("--max-tokens", 0), "--max-tokens"),
    "threads 0": (("--threads", 0), "--threads"),
    "threads too many": (("--threads", 4096), "--threads must be between 1 and"),
    "seed < 0": (("--seed", -1), "--seed"),
    "ctx 0": (("--ctx", 0), "--ctx"),
    "unknown flag": (("--frobnicate",), "No such option '--frobnicate'"),
}


@pytest.mark.parametrize("case", FLAG_CASES)
def test_bad_flag_is_one_line(models, case):
    flags, message = FLAG_CASES[case]
    assert_one_line_error(*fermijit("generate", "--model", models["q4"], PROMPT, *flags),
                          message)


def test_without_model_runs_the_embedded_one():
    """Issue 4: the default model (package data), sampled as its generation_config.json says."""
    prompt = "The Python list type"
    code, out, err = fermijit("generate", prompt, "--max-tokens", 12, *FLAGS)
    assert code == 0, err
    assert f"loaded {DEFAULT_MODEL} (4-bit fermijit)" in err
    temperature, top_k, top_p = sampling_settings(Settings(),
                                                  Tokenizer(DEFAULT_MODEL).generation_config)
    assert temperature > 0  # greedy decoding of a model this small falls into loops
    text, tokens = expected(DEFAULT_MODEL, prompt, 12, temperature=temperature, top_k=top_k,
                            top_p=top_p)
    assert out == text and len(tokens) == 12


def test_long_prefill_shows_progress():
    """A prompt of several prefill passes reports its progress (on the stream given)."""
    import io

    from fermijit.model.forward import PREFILL_BLOCK

    cfg, model = load_model(DEFAULT_MODEL)
    text = (Path(tiny.__file__).parent / "data" / "heldout_sample.txt").read_text(encoding="utf-8")
    prompt = Tokenizer(DEFAULT_MODEL).encode(text)[:PREFILL_BLOCK + 40]
    progress = io.StringIO()
    sampler = Sampler(model.vocab_size, temperature=0.0, top_k=0, top_p=1.0, seed=0)
    tokens, stats = generate(model, prompt, sampler, 2, prompt.size + 2, frozenset(),
                             lambda t: None, progress_to=progress)
    assert len(tokens) == 2 and stats.n_prompt == prompt.size
    assert "prefill" in progress.getvalue()
    assert f"{PREFILL_BLOCK}/{prompt.size}" in progress.getvalue()  # after the first pass
