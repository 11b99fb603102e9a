"""Issue 28 item 4 (start to ready <= 3 s with a warm kernel cache, the model in the page cache):
`serve` started in fresh processes (run by tests/gpu_start_bench.sh on the GPU host; it runs on
the CPU too, where the GPU modes report no GPU). A first start fills the kernel cache (reported
as "first"), then ROUNDS interleaved rounds of the modes (START_MODES; default MODES): default
(`serve --gpu-mem 6G --verbose`, --prefill auto), main (the start as before this branch), one
mode per change undone or varied (ENV says each one's environment: earlyreg0, the model file
registered after the load as before, not from exec), and cpu (`--prefill cpu`);
on request also pycuda, switch0, register1, refresh1, main-cpu, refresh1-cpu, warm0,
warm0-cpu (the CPU's path before helper start28cpu) and after (the GPU's
preparation after the warm-up: hybrid.preparing replaced by a sequential one).
Each start: seconds from Popen to "serving", the server's "ready in" line (load, kernels, the
GPU's seconds and when it began) and "gpu prefill ready" line (driver, experts, dense weights,
2-token pass, its module loads), then one 64-token request's time to first token and a second
one's (readiness: the first must not compile or upload more than the second; --prefill auto
prefills them on the GPU: gpu_tokens, from /health, says so). Last, one start under -X
importtime: the slowest top-level imports. `--probe`: whether registering the model file with the
driver (whole, then in serve's chunks) stalls another thread's mmap or Python. Prints a table of
medians, last a short one (exec to "ready", Popen to "serving", Popen to the first request's
first token); writes the rows as JSON and the logs under OUT. BUDGET_S: no round begins that
would end past it (estimated from the rounds before).

    python3 -m tests.fermijit.server.start_bench MODEL_DIR OUT [ROUNDS [BUDGET_S]]
"""

import json
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from tests.fermijit.server import start_profile
from tests.fermijit.server.test_serve_gpu import GPU_MEM

ROUNDS = 3
# START_MODES (comma-separated) picks the modes; default these (the device run decides the
# defaults from them).
MODES = ("default", "earlyreg0", "cpu")
# Each mode's environment beside the command's. "main": the start as main had it before this
# branch (each cached kernel's load refreshing Numba's context, the hand-off room and GDN pool
# page-locked after the GPU's start, no early driver); the others each undo or change one thing:
# "ahead0" the room after the GPU's start, "early0" no early driver thread (cli.py),
# "refresh1" Numba's refresh at every load, "popwhole" the model file's mapping pre-faulted in
# one call (model/safetensors_io.py populate: 32 MiB pieces), "nice0" its thread not niced,
# "regchunk64" the file registered in 64 MiB pieces; "popnow" the populate begun at the load,
# not after the warm-up (safetensors_io.populate_after); "earlyreg0" the model file mapped and
# registered by the GPU's preparation after the load, not from exec by the early driver thread
# (cli.py, fermijit/jit/gpu_early.py);
# "eager" the driver's module loading eager (CUDA_MODULE_LOADING=EAGER: each module's kernels
# JIT-compiled from the sm_20 PTX, or read from the driver's cache, at its load, not at their
# first launch inside the 2-token pass);
# "ptxstore0" each kernel's PTX rendered anew (jit/ptx.py: FERMIJIT_PTX_CACHE=0), not read from
# the rendered texts the first start stored; "gpuwhole" the GPU's 2-token pass over every layer,
# not one of each kind (hybrid.GPU_WARM_WHOLE_ENV);
# "pycuda" the GPU's start as it was before the driver-API path (pycuda's module loads and
# page-locking, one registering thread, Python's own switch interval); "switch0" the driver
# path with Python's own interval.
MAIN_ENV = {"FERMIJIT_LOAD_REFRESH": "1", "FERMIJIT_PIN_AHEAD": "0",
            "FERMIJIT_EARLY_DRIVER": "0", "FERMIJIT_POPULATE_CHUNK": "whole",
            "FERMIJIT_POPULATE_NICE": "0"}
# "warm0": the CPU's path as before helper start28cpu (issue 28 item 4): the collector on
# through the imports and the load, the serve warm-up's 2-token passes on the whole model's first
# layers and head, fresh states for each batched step.
CPU_WARM0_ENV = {"FERMIJIT_START_GC": "1", "FERMIJIT_WARM_WHOLE": "1"}
ENV = {"main": MAIN_ENV,
       "ahead0": {"FERMIJIT_PIN_AHEAD": "0"},
       "early0": {"FERMIJIT_EARLY_DRIVER": "0"},
       "earlyreg0": {"FERMIJIT_EARLY_REGISTER": "0"},
       "refresh1": {"FERMIJIT_LOAD_REFRESH": "1"},
       "popwhole": {"FERMIJIT_POPULATE_CHUNK": "whole"},
       "regchunk64": {"FERMIJIT_REGISTER_CHUNK": "64"},
       "regchunk256": {"FERMIJIT_REGISTER_CHUNK": "256"},
       "regchunk16": {"FERMIJIT_REGISTER_CHUNK": "16"},
       "reg8": {"FERMIJIT_REGISTER_THREADS": "8"},
       "nice0": {"FERMIJIT_POPULATE_NICE": "0"}, "nice0-cpu": {"FERMIJIT_POPULATE_NICE": "0"},
       "pycuda": {"FERMIJIT_GPU_LAUNCH": "pycuda", "FERMIJIT_START_SWITCH_S": "0",
                  "FERMIJIT_REGISTER_THREADS": "1"},
       "switch0": {"FERMIJIT_START_SWITCH_S": "0"},
       "eager": {"CUDA_MODULE_LOADING": "EAGER"},
       "passafter": {"FERMIJIT_GPU_PASS_AFTER": "1"},
       "ptxstore0": {"FERMIJIT_PTX_CACHE": "0"},
       "gpuwhole": {"FERMIJIT_GPU_WARM_WHOLE": "1"},
       "register1": {"FERMIJIT_REGISTER_THREADS": "1"},
       "cpu": {}, "main-cpu": MAIN_ENV, "refresh1-cpu": {"FERMIJIT_LOAD_REFRESH": "1"},
       "warm0": CPU_WARM0_ENV, "warm0-cpu": CPU_WARM0_ENV,
       "popnow": {"FERMIJIT_POPULATE_AFTER": "0"}, "popnow-cpu": {"FERMIJIT_POPULATE_AFTER": "0"}}

# `after`: the GPU's preparation once the CPU kernels are warm (the path serve takes without the
# omp threading layer), in the same process layout as `python -m fermijit`.
AFTER = """
import contextlib, sys, time
from fermijit.prefill import hybrid

@contextlib.contextmanager
def after(prefiller, then=None):
    result = {}
    yield result
    if not isinstance(prefiller, hybrid.CpuPrefiller):
        start = result["started"] = time.perf_counter()
        result["seconds"] = time.perf_counter() - start if prefiller.prepare() else None
        if then is not None and result["seconds"] is not None:
            start = time.perf_counter()
            result["then"] = then()
            result["then_s"] = time.perf_counter() - start

hybrid.preparing = after
sys.argv[0] = "fermijit"
from fermijit.cli import main
main()
"""


def command(model_dir: Path, mode: str, python_flags: tuple = ()) -> list[str]:
    serve = ["serve", "--model", str(model_dir), "--port", "0", "--verbose"]
    serve += ["--prefill", "cpu"] if mode.endswith("cpu") else ["--gpu-mem", GPU_MEM]
    if mode == "after":
        return [sys.executable, *python_flags, "-c", AFTER, *serve]
    return [sys.executable, *python_flags, "-m", "fermijit", *serve]


def start(model_dir: Path, mode: str, log: Path, python_flags: tuple = (),
          requests: bool = True) -> dict:
    """One start: its figures (see the module's doc), its stderr appended to `log`."""
    import os

    t0 = time.perf_counter()
    proc = subprocess.Popen(command(model_dir, mode, python_flags), stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, **ENV.get(mode, {})})
    lines, url, row = [], None, {"mode": mode}
    for line in proc.stderr:
        lines.append(line)
        match = re.search(r"serving on (http://\S+)/v1", line)
        if match:
            row["serving_s"], url = time.perf_counter() - t0, match.group(1)
            break
    try:
        if url is not None and requests:
            import httpx

            from tests.fermijit.server.test_serve_gpu import _ttft

            vocab = 1000
            ids = np.random.default_rng(len(lines)).integers(300, vocab, (2, 64)).tolist()
            try:
                with httpx.Client(base_url=url, timeout=600) as client:
                    row["first_request_s"] = _ttft(client, ids[0])
                    row["served_s"] = time.perf_counter() - t0  # Popen to its first token
                    row["second_request_s"] = _ttft(client, ids[1])
                    row["gpu_tokens"] = client.get("/health").json()["prefilled_tokens"].get(
                        "gpu", 0)
            except Exception as e:  # noqa: BLE001 - reported, the bench goes on
                row["request_error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rest = proc.communicate(timeout=60)[1]
        except subprocess.TimeoutExpired:
            proc.kill()
            rest = proc.communicate()[1]
    row["took_s"] = time.perf_counter() - t0
    text = "".join(lines) + (rest or "")
    with open(log, "a") as f:
        f.write(f"=== {mode} ===\n{text}")
    ready = re.search(r"ready in ([\d.]+) s \((.*?)\); serving", text)
    if ready:
        row["ready_s"] = float(ready.group(1))
        for part in ready.group(2).split(", "):
            m = re.match(r"(.+?) ([\d.]+)(?: from ([\d.]+))?$", part)
            if m:
                row[m.group(1)] = float(m.group(2))
                if m.group(3):
                    row[m.group(1) + " from"] = float(m.group(3))
    gpu = re.search(r"gpu prefill ready: (.*)", text)
    if gpu:
        for part in gpu.group(1).split(", "):
            m = re.match(r"(.+?) ([\d.]+) s$", part)
            if m:
                row["gpu: " + m.group(1)] = float(m.group(2))
    # The requests' GPU passes (--verbose): the first's against the second's, phase by phase
    passes = [ln.split(": ", 1)[1] for ln in text.splitlines()
              if ln.startswith("gpu prefill of ") and ": " in ln]
    for name, line in zip(("first_request_gpu", "second_request_gpu"), passes):
        row[name] = line
    row["said"] = [ln.strip() for ln in text.splitlines()
                   if "ready" in ln or "unavailable" in ln or "Error" in ln][:6]
    if "request_error" in row:
        row["said"].append(row["request_error"])
    return row


def imports(model_dir: Path, log: Path) -> list[tuple[float, str]]:
    """The slowest top-level imports of a default start under -X importtime."""
    t0 = time.perf_counter()
    _, text = start_profile.start(model_dir, ["-X", "importtime"])
    with open(log, "a") as f:
        f.write(f"importtime start: {time.perf_counter() - t0:.2f} s\n")
    return start_profile.top_level_imports(text)


def register_probe(model_dir: Path, chunk: int | None = None) -> str:
    """Whether registering the model file with the driver (the experts' "mapped" source: ~0.6 s
    at full size) stalls another thread's mmap/munmap (the process's memory-map lock: the CPU
    kernels' loading maps memory) or its Python (the GIL): a thread maps and unmaps 1 MiB every
    millisecond, another counts, beside gpu.register of the whole file."""
    import mmap
    import threading

    from fermijit.jit import gpu

    if gpu.unavailable_reason() is not None:
        return f"register probe: no GPU ({gpu.unavailable_reason()})"
    gpu.driver()
    path = model_dir / "model.safetensors"
    root = np.memmap(path, np.uint8, "r")
    page = mmap.PAGESIZE
    first = root.ctypes.data // page * page
    size = -(-(root.ctypes.data + root.nbytes) // page) * page - first
    maps, counts, stop = [], [0], [False]

    def mapper():
        while not stop[0]:
            t = time.perf_counter()
            m = mmap.mmap(-1, 1 << 20)
            m[0] = 1
            m.close()
            maps.append(time.perf_counter() - t)
            time.sleep(0.001)

    def counter():
        while not stop[0]:
            counts[0] += 1

    threads = [threading.Thread(target=f) for f in (mapper, counter)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    before, n_before = len(maps), counts[0]
    t0 = time.perf_counter()
    step = chunk or size
    held = [gpu.register(at, min(step, first + size - at))
            for at in range(first, first + size, step)]
    reg_s = time.perf_counter() - t0
    during, n_during = maps[before:], counts[0] - n_before
    time.sleep(reg_s)
    n_after = counts[0] - n_before - n_during
    stop[0] = True
    for t in threads:
        t.join()
    outcome = "refused" if any(h is None for h in held) else "registered"
    del held
    import gc

    gc.collect()  # unregistered
    return (f"register probe: gpu.register of {size / 1e9:.1f} GB in {len(range(0, size, step))} "
            f"piece(s) took {reg_s:.2f} s ({outcome}); beside it a 1 MiB mmap+munmap "
            f"took at most {max(during, default=0) * 1e3:.1f} ms ({len(during)} of them; "
            f"{max(maps[:before], default=0) * 1e3:.1f} ms before), a counting thread counted "
            f"{n_during} (then {n_after} in as long)")


KEYS = ("ready_s", "serving_s", "served_s", "imports", "load", "kernels", "gpu prefill",
        "gpu prefill from", "gpu room", "gpu room from", "waited for the gpu", "gpu: driver",
        "gpu: experts (mapped)", "gpu: experts (pinned)", "gpu: dense weights",
        "gpu: waited for the CPU", "gpu: kernels (2-token pass)", "gpu: of which module loads",
        *(f"gpu: 2-token pass: {phase}" for phase in ("plan", "state in", "pass buffers",
                                                      "layers", "logits", "state out")),
        "early registration",
        "early registration from", "early chunks", "adopted", "first_request_s",
        "second_request_s", "gpu_tokens")
# The short table's rows, last: "ready in" (from the process's exec), Popen to "serving",
# Popen to the first request's first token.
SHORT = {"ready_s": "exec->ready", "serving_s": "Popen->serving", "served_s": "Popen->1st token"}


def main(model_dir: Path, out: Path, rounds: int = ROUNDS, budget_s: float | None = None) -> None:
    """`budget_s`: no round begins once this many seconds have gone (the device script's)."""
    import os

    began = time.perf_counter()
    modes = tuple(os.environ.get("START_MODES", ",".join(MODES)).split(","))
    out.mkdir(parents=True, exist_ok=True)
    log = out / "start-bench.log"
    first = start(model_dir, modes[0], log)  # the kernel cache filled as it goes (a cold one)
    rows = {mode: [] for mode in modes}
    done = 0
    for r in range(rounds):
        spent = time.perf_counter() - began
        if budget_s is not None and r and spent + (spent - first.get("took_s", 0)) / r > budget_s:
            print(f"(the budget of {budget_s:.0f} s allows {r} rounds)")
            break
        for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
            rows[mode].append(start(model_dir, mode, log))
        done = r + 1
    slow = imports(model_dir, log) if os.environ.get("START_IMPORTS", "1") != "0" else []
    (out / "start-bench.json").write_text(json.dumps({"first": first, "rounds": rows},
                                                     indent=1))
    errors = [r["request_error"] for m in modes for r in rows[m] if "request_error" in r]
    if errors:
        print(f"{len(errors)} start(s) failed a request, e.g. {errors[0]}")
    for m in modes:  # the last round's GPU passes of the two requests, where there were some
        last = rows[m][-1] if rows[m] else {}
        for name in ("first_request_gpu", "second_request_gpu"):
            if name in last:
                print(f"{m} {name}: {last[name]}")
    print(f"medians of {done} fresh starts per mode (seconds; each mode's env: "
          f"{ {m: ENV[m] for m in modes if ENV.get(m)} }):")
    print(f"{'':30s}" + "".join(f"{m:>11s}" for m in modes))
    table = [k for k in KEYS if k not in SHORT] + list(SHORT)
    for key in table:
        values = [[row[key] for row in rows[m] if key in row] for m in modes]
        if any(values):
            print(f"{SHORT.get(key, key):30s}"
                  + "".join(f"{statistics.median(v):11.2f}" if v else f"{'-':>11s}"
                            for v in values))
    if slow:
        print("slowest top-level imports (-X importtime, default start): "
              + ", ".join(f"{name} {s:.2f}" for s, name in slow[:8]))
    print(f"first start ({modes[0]}, the kernel cache cold): exec->ready "
          f"{first.get('ready_s', float('nan')):.2f}, Popen->serving "
          f"{first.get('serving_s', float('nan')):.2f}, Popen->1st token "
          f"{first.get('served_s', float('nan')):.2f} s; {' | '.join(first['said'][:2])}")


def register_threads_probe(model_dir: Path) -> str:
    """Seconds to register the model file's expert pages as serve does
    (expert_stream._register_in_place, gpu_early.REGISTER_CHUNK_BYTES chunks) on 1, 2, 4 and 8
    threads, each registration dropped (unregistered) before the next."""
    import gc
    import os

    from fermijit.jit import gpu, gpu_early
    from fermijit.prefill import expert_stream

    if gpu.unavailable_reason() is not None:
        return f"register threads probe: no GPU ({gpu.unavailable_reason()})"
    gpu.driver()
    root = np.memmap(model_dir / "model.safetensors", np.uint8, "r")
    said = []
    for n in (1, 2, 4, 8):
        os.environ[gpu_early.REGISTER_THREADS_ENV] = str(n)
        t0 = time.perf_counter()
        held = expert_stream._register_in_place([(root,)])
        took = time.perf_counter() - t0
        said.append(f"{n} thread(s) {took:.2f} s{'' if held else ' (refused)'}")
        del held
        gc.collect()
    return "register threads probe (the whole file, serve's chunks): " + ", ".join(said)


if __name__ == "__main__":
    if sys.argv[1] == "--probe":  # the whole file at once, then as serve registers it
        from fermijit.jit import gpu_early

        print(register_probe(Path(sys.argv[2])))
        print(register_probe(Path(sys.argv[2]), gpu_early.REGISTER_CHUNK_BYTES))
        print(register_threads_probe(Path(sys.argv[2])))
        sys.exit()
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else ROUNDS,
         float(sys.argv[4]) if len(sys.argv) > 4 else None)
