"""serve's start (issue 28 item 4): the load and the warm-up import nothing heavy they do not
need; "ready in" counts from the process's exec; the early driver thread only for a `serve` that
may use the GPU."""

from __future__ import annotations

import subprocess
import sys
import time

# Packages the load and the warm-up must not import (the HTTP side comes once ready; the GPU's
# only on the GPU path; the others are training/conversion tools': seconds each).
HEAVY = {"torch", "transformers", "PIL", "safetensors", "scipy", "pandas", "matplotlib",
         "uvicorn", "starlette", "httpx", "pycuda", "gguf", "huggingface_hub"}

SCRIPT = """
import sys
from fermijit.engine import DEFAULT_MODEL, Engine
from fermijit.prefill import hybrid
from fermijit.server.run import warm_up

engine = Engine.load(DEFAULT_MODEL)
with hybrid.preparing(hybrid.make(engine.model, "cpu")):
    warm_up(engine, 8)
print(" ".join(sorted({m.split(".")[0] for m in sys.modules})))
"""


def test_the_load_and_warm_up_import_nothing_heavy():
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    assert HEAVY & set(r.stdout.split()) == set()


def test_seconds_since_exec_counts_from_the_process_s_start():
    code = ("import time; time.sleep(0.5); from fermijit.server.run import seconds_since_exec; "
            "print(seconds_since_exec())")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    took = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    assert 0.5 <= float(r.stdout) <= took + 0.02  # /proc's clock ticks: 10 ms steps


def test_the_driver_starts_early_only_for_a_serve_that_may_use_the_gpu(monkeypatch):
    from fermijit import cli
    from fermijit.jit import gpu_early

    plans = []
    monkeypatch.setattr(gpu_early, "start", plans.append)
    assert cli._start_driver_early(["serve", "--model", "m"])
    assert cli._start_driver_early(["--isa", "avx2", "serve", "--prefill", "gpu"])
    for argv in (["serve", "--prefill", "cpu"], ["serve", "--prefill=cpu"], ["serve", "--help"],
                 ["generate", "hi"], ["bench", "serve"]):
        assert not cli._start_driver_early(argv), argv
    monkeypatch.setenv(cli.EARLY_REGISTER_ENV, "0")  # the driver only
    assert cli._start_driver_early(["serve"])
    monkeypatch.setenv(cli.EARLY_DRIVER_ENV, "0")
    assert not cli._start_driver_early(["serve"])
    assert len(plans) == 3 and callable(plans[0]) and plans[2] is None


def test_the_early_registration_is_decided_as_the_gpu_s_preparation_decides(monkeypatch,
                                                                            tmp_path):
    """The weights file fermijit.json names, within --pin-budget (default half the RAM), placed
    by the --numa policy; nothing for the embedded model, a GGUF file or an HF checkpoint."""
    from fermijit import cli
    from fermijit.host import numa
    from fermijit.prefill import hybrid

    (tmp_path / "fermijit.json").write_text('{"weights": "w.safetensors"}')
    plan = cli._early_registration
    weights, budget, place = plan(["serve", "--model", str(tmp_path), "--numa", "off"])
    assert weights == tmp_path / "w.safetensors" and place is None
    assert budget == hybrid.default_pin_budget()
    assert plan(["serve", f"--model={tmp_path}", "--pin-budget", "1.5G", "--numa=off"])[1] \
        == 3 << 29
    placed = []
    monkeypatch.setattr(numa, "apply_to", lambda ranges, policy: placed.append((ranges, policy)))
    _, _, place = plan(["serve", "--model", str(tmp_path), "--numa", "interleave"])
    place(4096, 100)
    assert placed == [([(4096, 100)], "interleave")]
    monkeypatch.setattr(numa, "default_policy", lambda: "off")
    assert plan(["serve", "--model", str(tmp_path)])[2] is None
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    for argv in (["serve"], ["serve", "--model", str(gguf)], ["serve", "--model", "/nowhere"],
                 ["serve", "--model", str(tmp_path / "..")]):
        assert plan(argv) is None, argv


def test_a_serve_stopped_before_its_load_leaves_the_collector_on(monkeypatch, capsys):
    # cli.main turns the cyclic collector off for a serve's imports and load (server/run.py
    # turns it back on): a serve that fails before, run in-process, must not leave it off.
    import gc

    from fermijit import cli
    from fermijit.server import run
    from tests.cli import run_cli

    def listen(host, port):
        raise AssertionError("serve went on to listen")

    monkeypatch.setattr(run, "listen", listen)
    monkeypatch.setenv(cli.EARLY_DRIVER_ENV, "0")
    code, _, err = run_cli(monkeypatch, capsys, "serve", "--api-key", "", "--port", "0")
    assert code == 2, err
    assert gc.isenabled()
