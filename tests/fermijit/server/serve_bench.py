"""Issue 28's serve figures on the GPU host (run by tests/gpu_serve_bench.sh): medians of ROUNDS
interleaved rounds, each of three fresh processes in a rotating order:
  - `serve` with the defaults (--speculative auto: off at this size, speculative.pays) and --verbose (the GPU prefill says each call's sequences, rows and
    phases in the log): time to first token through HTTP at LENGTHS prompt tokens, then a
    64-token prompt alone (the median of 3) and twice N_CONCURRENT of them at once (the last
    first token: were they prefilled together? The server's first such batch also grows its
    page-locked hand-off buffer and its device memory pool: reported apart);
  - `serve --speculative mtp` (the MTP head synth writes drafts, so its rows run in the GPU pass
    too): the same LENGTHS;
  - the GPU prefill alone at LENGTHS (GpuPrefiller.run, best of 2, as `bench prefill` times it;
    test_serve_gpu._bench_seconds): the reference.
Prints a table; writes the rounds as JSON and the servers' logs under OUT.

    python3 -m tests.fermijit.server.serve_bench MODEL_DIR OUT
"""

import concurrent.futures
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.fermijit.server.test_serve_gpu import _bench_seconds, _start, _stop, _ttft

ROUNDS = 3
LENGTHS = (1024, 4096, 16384)
N_CONCURRENT, N_SHORT = 8, 64


def prompt_ids(model_dir: Path, seed: int):
    """ids(n): n random token ids (fresh ones: no prefix-cache hits)."""
    vocab = json.loads((model_dir / "config.json").read_text())
    vocab = vocab.get("text_config", vocab)["vocab_size"]
    rng = np.random.default_rng(seed)
    return lambda n: rng.integers(300, vocab - 300, n).tolist()


def serve_round(model_dir: Path, log: Path, flags: tuple, with_concurrent: bool,
                seed: int) -> dict:
    import httpx

    ids = prompt_ids(model_dir, seed)

    proc, url, start_s = _start(model_dir, log, flags)
    try:
        with httpx.Client(base_url=url, timeout=600) as client:
            row = {"ttft": {}, "on_gpu": {}, "start_s": start_s}
            # the first request loads what the warm-up did not (reported: the server reserves
            # its batch's hand-off room as it starts serving, scheduler._serve)
            row["first_request"] = _ttft(client, ids(512))
            for n in LENGTHS:
                before = client.get("/health").json()["prefilled_tokens"].get("gpu", 0)
                row["ttft"][n] = _ttft(client, ids(n))
                row["on_gpu"][n] = client.get("/health").json()["prefilled_tokens"].get(
                    "gpu", 0) - before
            if with_concurrent:
                row["short_alone"] = statistics.median(_ttft(client, ids(N_SHORT))
                                                       for _ in range(3))
                for key in ("short_together_first", "short_together"):
                    prompts = [ids(N_SHORT) for _ in range(N_CONCURRENT)]
                    with concurrent.futures.ThreadPoolExecutor(N_CONCURRENT) as pool:
                        row[key] = list(pool.map(lambda p: _ttft(client, p), prompts))
    finally:
        with open(log, "a") as out:
            out.write(_stop(proc))
    return row


def prefill_round(model_dir: Path, log: Path, seed: int) -> dict:
    """The GPU prefill alone, in a process of its own (as the servers are): `main`'s prefill."""
    proc = subprocess.run([sys.executable, "-m", "tests.fermijit.server.serve_bench", "prefill",
                           str(model_dir), str(seed)], capture_output=True, text=True,
                          timeout=600)
    with open(log, "a") as out:
        out.write(proc.stderr)
    if proc.returncode:
        raise SystemExit(f"the GPU prefill alone failed: see {log}")
    return {int(n): s for n, s in json.loads(proc.stdout.splitlines()[-1]).items()}


def main(model_dir: Path, out: Path) -> None:
    runs = {"default": [], "mtp": [], "prefill": []}
    # --verbose: the GPU prefill says each call's sequences, rows and phases in the log
    jobs = [("default", lambda r: serve_round(model_dir, out / "serve-default.log",
                                              ("--verbose",), True, r)),
            ("mtp", lambda r: serve_round(model_dir, out / "serve-mtp.log",
                                          ("--speculative", "mtp"), False, r)),
            ("prefill", lambda r: prefill_round(model_dir, out / "prefill.log", r))]
    for r in range(ROUNDS):
        for name, job in jobs[r % 3:] + jobs[:r % 3]:       # a rotating order
            print(f"round {r + 1}: {name}", file=sys.stderr, flush=True)
            runs[name].append(job(r))
            (out / "serve-bench.json").write_text(json.dumps(runs, indent=1))

    def median(name, n):
        return statistics.median((x["ttft"] if name != "prefill" else x)[n] for x in runs[name])

    print(f"medians of {ROUNDS} interleaved rounds (fresh processes), seconds to first token")
    print(f"{'tokens':>6}  {'prefill alone':>13}  {'serve default':>13}  {'ratio':>6}  "
          f"{'serve --spec mtp':>17}  {'ratio':>6}  on the GPU (default, mtp)")
    for n in LENGTHS:
        p, d, s = median("prefill", n), median("default", n), median("mtp", n)
        on_gpu = [min(x["on_gpu"][n] for x in runs[k]) for k in ("default", "mtp")]
        print(f"{n:>6}  {p:>13.3f}  {d:>13.3f}  {d / p:>5.2f}x  {s:>17.3f}  {s / p:>5.2f}x  "
              f"{on_gpu[0] == n}, {on_gpu[1] == n}")
    starts = [x["start_s"] for k in ("default", "mtp") for x in runs[k]]
    print(f"start, Popen to 'serving' (s): first process {starts[0]:.2f}, the others' median "
          f"{statistics.median(starts[1:]):.2f} (all: {', '.join(f'{s:.2f}' for s in starts)}); "
          f"a 512-token first request's first token: median "
          f"{statistics.median(x['first_request'] for x in runs['default']):.3f} s")
    alone = statistics.median(x["short_alone"] for x in runs["default"])
    for key, what in (("short_together", "a second batch"),
                      ("short_together_first", "the server's first batch")):
        last = statistics.median(max(x[key]) for x in runs["default"])
        print(f"{N_CONCURRENT} concurrent {N_SHORT}-token prompts (serve default, {what}): the "
              f"last first token after {last:.3f} s, one prompt alone {alone:.3f} s: "
              f"{last / alone:.2f}x")


if __name__ == "__main__":
    if sys.argv[1] == "prefill":  # prefill_round's process: the seconds per length as JSON
        ids = prompt_ids(Path(sys.argv[2]), int(sys.argv[3]))
        print(json.dumps(_bench_seconds(Path(sys.argv[2]), {n: ids(n) for n in LENGTHS})))
    else:
        main(Path(sys.argv[1]), Path(sys.argv[2]))
