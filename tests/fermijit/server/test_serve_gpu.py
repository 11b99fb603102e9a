"""`serve` with the GPU prefill at full size, as a user runs it (issue 28 items 1, 3, 4): the
server process on a full-size model with `--gpu-mem 6G`, prompts of 1k, 4k and 16k token ids
through the HTTP API. Each must be prefilled on the GPU (the server's /health counts prompt tokens
per device) with its first token within TTFT_OVER_BENCH of the GPU prefill's own time for that
length in this process (GpuPrefiller.run, as `bench prefill` times it: the hand-off of the state
included). The server's peak RSS must stay within the model file plus SERVE_RSS_MARGIN and the KV
and GDN state of its sequences (one copy of the experts, not a page-locked second one). Start-up
(process start to the "serving" line) is printed for a first and a second start.

Runs where FERMIJIT_FULL_MODEL names a full-size model directory and a GPU is usable
(tests/gpu_pass.sh synthesises reap128 into /dev/shm for it); skipped everywhere else.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.gpu import MARKS

MODEL = os.environ.get("FERMIJIT_FULL_MODEL")
pytestmark = MARKS + [pytest.mark.skipif(not MODEL, reason="FERMIJIT_FULL_MODEL is not set")]

LENGTHS = (1024, 4096, 16384)
GPU_MEM = "6G"
# Issue 28 item 1: the first token through HTTP within 1.5x the prefill alone (tokenising is
# skipped: the prompts are ids; what is left is the request, the scheduler's hand-over, the
# prefix cache's snapshot at the prompt's end and the first sample).
TTFT_OVER_BENCH = 1.5
GIB = 1 << 30
# Issue 28 item 3: `serve` within the model file + 2 GB + its sequences' KV and GDN state.
SERVE_RSS_MARGIN = 2 * GIB
# Issue 28 item 3: `generate --prefill gpu` within the model file + 1.5 GB.
GENERATE_RSS_MARGIN = 1.5 * GIB
START_TIMEOUT_S = 600


def _file_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.iterdir() if f.is_file())


def _start(model_dir: Path, log: Path, flags: tuple = ()) -> tuple[subprocess.Popen, str, float]:
    """A `serve` process with the defaults a user gets (--prefill auto; --speculative auto,
    off at this size: speculative.pays) but
    --gpu-mem GPU_MEM, then `flags`; (process, base url, seconds from start to its "serving"
    line)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "fermijit", "serve", "--model", str(model_dir),
                             "--port", "0", "--gpu-mem", GPU_MEM, *flags],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    with open(log, "a") as out:
        for line in proc.stderr:
            out.write(line)
            match = re.search(r"serving on (http://\S+)/v1", line)
            if match:
                ready_s = time.perf_counter() - start
                break
            if time.perf_counter() - start > START_TIMEOUT_S:
                break
        else:
            line = ""
    if not match:
        proc.kill()
        pytest.fail(f"serve did not start: see {log}")
    return proc, match.group(1), ready_s


def _stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    try:
        _, rest = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, rest = proc.communicate()
    return rest or ""


def _ttft(client, ids: list[int]) -> float:
    """Seconds from sending a streamed completion of `ids` to its first token's chunk."""
    body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start, first = time.perf_counter(), None
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {") and first is None:
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk["choices"] and chunk["choices"][0].get("text"):
                    first = time.perf_counter()
    return (first or time.perf_counter()) - start


def _peak_rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


def _bench_seconds(model_dir: Path, prompts: dict) -> dict:
    """The GPU prefill alone per length, best of 2, as `bench prefill` times it."""
    from fermijit.model.forward import load_model
    from fermijit.prefill import hybrid

    model = load_model(model_dir)[1]
    pf = hybrid.GpuPrefiller(model, hybrid.parse_bytes(GPU_MEM))
    assert pf.prepare(), pf.broken
    seconds = {}
    for n, ids in prompts.items():
        times = []
        for _ in range(2):
            state = model.new_state(n + 2)
            start = time.perf_counter()
            pf.run(np.asarray(ids, np.int32), state)
            times.append(time.perf_counter() - start)
        seconds[n] = min(times)
    return seconds


def test_serve_prefills_on_the_gpu(tmp_path):
    import httpx

    model_dir = Path(MODEL)
    vocab = json.loads((model_dir / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    rng = np.random.default_rng(28)
    prompts = {n: rng.integers(300, vocab - 300, n).tolist() for n in LENGTHS}
    log = tmp_path / "serve.log"

    proc, url, first_start_s = _start(model_dir, log)
    try:
        ttft, on_gpu = {}, {}
        with httpx.Client(base_url=url, timeout=600) as client:
            # A first request pays for what the 2-token warm-up pass did not load (measured
            # 0.25 s on the H200): said, not held to the bound.
            cold_s = _ttft(client, rng.integers(300, vocab - 300, 512).tolist())
            for n, ids in prompts.items():
                before = client.get("/health").json()["prefilled_tokens"]
                ttft[n] = _ttft(client, ids)
                after = client.get("/health").json()["prefilled_tokens"]
                on_gpu[n] = after.get("gpu", 0) - before.get("gpu", 0)
        peak = _peak_rss(proc.pid)
    finally:
        rest = _stop(proc)
    log.write_text(log.read_text() + rest)
    proc, _, warm_start_s = _start(model_dir, log)
    _stop(proc)

    bench = _bench_seconds(model_dir, prompts)
    file_bytes = _file_bytes(model_dir)
    print(f"serve start to ready: first {first_start_s:.1f} s, second {warm_start_s:.1f} s")
    print(f"the first request (512 tokens): TTFT {cold_s:.2f} s")
    print(f"serve peak RSS {peak / GIB:.2f} GiB, model files {file_bytes / GIB:.2f} GiB")
    for n in LENGTHS:
        print(f"prompt {n:6d}: TTFT {ttft[n]:7.2f} s, GPU prefill alone {bench[n]:7.2f} s "
              f"({ttft[n] / bench[n]:.2f}x), {on_gpu[n]} tokens on the GPU")
    print(log.read_text()[-3000:])
    assert all(on_gpu[n] == n for n in LENGTHS), on_gpu
    assert all(ttft[n] <= TTFT_OVER_BENCH * bench[n] for n in LENGTHS), (ttft, bench)
    # The sequences' state: each prompt's KV caches and GDN states.
    from fermijit.model.forward import load_model

    model = load_model(model_dir)[1]
    states = sum(model.new_state(n + 2).nbytes for n in LENGTHS)
    assert peak <= file_bytes + SERVE_RSS_MARGIN + states, (peak, file_bytes, states)


def _generate(model_dir: Path, prefill: str, prompt: str) -> dict:
    """One `generate` process: its summary line's peak RSS and decode rate."""
    proc = subprocess.run([sys.executable, "-m", "fermijit", "generate", "--model",
                           str(model_dir), "--prefill", prefill, "--gpu-mem", GPU_MEM,
                           "--temperature", "0", "--max-tokens", "64", "--no-cache", prompt],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = [line for line in proc.stderr.splitlines() if "peak RSS" in line]
    assert summary, proc.stderr[-2000:]
    summary = summary[-1]
    return {"rss": int(re.search(r"peak RSS (\d+) MiB", summary).group(1)) << 20,
            "decode": float(re.search(r"decode ([0-9.]+) tok/s", summary).group(1)),
            "gpu": "gpu prefill ready" in proc.stderr, "summary": summary}


def test_generate_keeps_one_copy_of_the_experts():
    """Issue 28 item 3: `generate --prefill gpu` within the model file + GENERATE_RSS_MARGIN, and
    its decode as fast as after a CPU prefill (printed: rounds interleaved, the ratio of medians;
    a speed is measured here, not asserted)."""
    model_dir = Path(MODEL)
    prompt = ("def read(path):\n    with open(path) as f:\n        return f.read()\n" * 20)[:947]
    runs = {"gpu": [], "cpu": []}
    for _ in range(2):
        for prefill in runs:
            runs[prefill].append(_generate(model_dir, prefill, prompt))
    file_bytes = _file_bytes(model_dir)
    for prefill, rows in runs.items():
        rss = ", ".join(f"{r['rss'] / GIB:.2f}" for r in rows)
        decode = ", ".join(f"{r['decode']:.2f}" for r in rows)
        print(f"generate --prefill {prefill}: peak RSS {rss} GiB (files {file_bytes / GIB:.2f}), "
              f"decode {decode} tok/s")
    ratio = (np.median([r["decode"] for r in runs["gpu"]])
             / np.median([r["decode"] for r in runs["cpu"]]))
    print(f"decode after a GPU prefill / after a CPU prefill: {ratio:.3f}")
    assert all(r["gpu"] for r in runs["gpu"]), runs["gpu"][0]["summary"]
    assert max(r["rss"] for r in runs["gpu"]) <= file_bytes + GENERATE_RSS_MARGIN
