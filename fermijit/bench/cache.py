"""`python -m fermijit bench cache`: what the snapshot prefix cache saves.

A prompt of N random token ids (947 by default), prefilled on the CPU as `generate` does:

    cold       no cache: the whole prompt
    cold+snap  an empty cache: the whole prompt, snapshots taken on the way (what they cost)
    repeated   the same prompt again: restored with its logits, no forward
    extended   the prompt and 32 more tokens: restored at N, the 32 prefilled
    32 alone   those 32 tokens prefilled on a copy of the state at N, no cache: extended's floor
    branched   the prompt cut at a random point, 32 other tokens after: restored at the
               snapshot below the cut, the rest prefilled

Each is timed `repeat` times, the cases interleaved within a repetition (other processes share
the machine: a ratio within one run is what holds), and the median kept. Then the cache's bytes
and snapshots after cold+snap, one snapshot's GDN bytes and a token's KV bytes; and the cost of
taking one snapshot in prefill tokens, the measure behind prefix_cache.SNAPSHOT_EVERY. `--sweep`
adds, per snapshot interval, cold+snap against cold and the mean branched time over the cuts.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

N_EXTEND = 32
SWEEP = (64, 128, 256, 512)
# Long enough that every op takes its parallel kernel (ops' PARALLEL_MIN_ELEMENTS, 1 << 16 at
# most, over 384 hidden), so no compile lands in a timed case.
WARM_UP_PREFILL = 256


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def measure(model, prompt: np.ndarray, snapshot_every: int, repeat: int, rng) -> dict:
    from fermijit.cache.prefix_cache import PrefixCache
    from fermijit.engine import prefill

    n = prompt.size
    context = n + N_EXTEND
    extension = rng.integers(0, model.vocab_size, N_EXTEND).astype(np.int32)
    extended = np.concatenate([prompt, extension])
    times: dict[str, list[float]] = {}
    cached: dict[str, int] = {}
    for _ in range(repeat):
        cut = int(rng.integers(1, n))
        branched = np.concatenate([prompt[:cut], extension]).astype(np.int32)
        cold_state = model.new_state(context)
        t_cold, _ = _timed(lambda: model.prefill(prompt, cold_state))
        cache = PrefixCache("bench", mem_bytes=2 ** 40, snapshot_every=snapshot_every)
        runs = {"cold": t_cold}
        for case, tokens in (("cold+snap", prompt), ("repeated", prompt),
                             ("extended", extended), ("branched", branched)):
            runs[case], (_, _, cached[case]) = _timed(
                lambda: prefill(model, tokens, context, cache))
            if case == "cold+snap":
                cached["bytes"], cached["snapshots"] = cache.nbytes, cache.n_snapshots
        alone = cold_state.copy()
        runs["32 alone"], _ = _timed(lambda: model.prefill(extension, alone))
        one = PrefixCache("bench", mem_bytes=2 ** 40)
        one.add(prompt, cold_state)  # the KV rows: taken once per sequence, during prefill
        runs["one snapshot"], _ = _timed(lambda: one.add(prompt, cold_state))  # GDN states
        for case, t in runs.items():
            times.setdefault(case, []).append(t)
    median = {case: statistics.median(ts) for case, ts in times.items()}
    return {"median_s": median, "n_cached": cached, "repeat": repeat,
            "state_nbytes": cold_state.nbytes}


def run(model_dir: Path, n_prompt: int, snapshot_every: int, repeat: int, sweep: bool,
        as_json: bool, seed: int = 0) -> None:
    from fermijit.engine import warm_up
    from fermijit.model.forward import load_model
    from fermijit.model.state import GdnState, KvCache

    _, model = load_model(model_dir)
    n_prompt = min(n_prompt, model.max_context - N_EXTEND)
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, model.vocab_size, n_prompt).astype(np.int32)
    warm_up(model, prompt, n_prefill=min(n_prompt, WARM_UP_PREFILL))
    main = measure(model, prompt, snapshot_every, repeat, rng)
    state = model.new_state(1)
    gdn_nbytes = sum(s.conv.nbytes + s.recurrent.nbytes for s in state.layers
                     if isinstance(s, GdnState))
    kv_token_nbytes = sum(s.k.nbytes + s.v.nbytes for s in state.layers
                          if isinstance(s, KvCache))
    m = main["median_s"]
    per_token_s = m["cold"] / n_prompt
    report = {
        "model": str(model_dir), "n_prompt": n_prompt, "n_extend": N_EXTEND,
        "snapshot_every": snapshot_every, "repeat": repeat,
        "rows": [{"case": case, "seconds": m[case], "speedup_vs_cold": m["cold"] / m[case],
                  "n_cached": main["n_cached"].get(case)}
                 for case in ("cold", "cold+snap", "repeated", "extended", "32 alone",
                              "branched")],
        "extended_vs_32_alone": m["extended"] / m["32 alone"],
        "cache_nbytes": main["n_cached"]["bytes"], "n_snapshots": main["n_cached"]["snapshots"],
        "snapshot_gdn_nbytes": gdn_nbytes, "kv_nbytes_per_token": kv_token_nbytes,
        "snapshot_s": m["one snapshot"], "snapshot_in_prefill_tokens": m["one snapshot"]
        / per_token_s,
        "sweep": [],
    }
    if sweep:
        for every in SWEEP:
            r = measure(model, prompt, every, repeat, rng)["median_s"]
            report["sweep"].append({"snapshot_every": every,
                                    "cold_snap_vs_cold": r["cold+snap"] / r["cold"],
                                    "branched_s": r["branched"], "cold_s": r["cold"]})
    if as_json:
        print(json.dumps(report, indent=1))
        return
    print(f"model {model_dir}: a {n_prompt}-token prompt, snapshots every {snapshot_every}, "
          f"median of {repeat}")
    print(f"{'case':<11} {'seconds':>9} {'vs cold':>9} {'from cache':>11}")
    for row in report["rows"]:
        n_cached = "" if row["n_cached"] is None else str(row["n_cached"])
        print(f"{row['case']:<11} {row['seconds']:>9.4f} {row['speedup_vs_cold']:>8.1f}x "
              f"{n_cached:>11}")
    print(f"extended / 32 alone: {report['extended_vs_32_alone']:.2f}")
    print(f"cache after cold+snap: {report['n_snapshots']} snapshots, "
          f"{report['cache_nbytes'] / 2**20:.1f} MiB (GDN state {gdn_nbytes / 2**20:.2f} MiB a "
          f"snapshot, KV {kv_token_nbytes / 2**10:.1f} KiB a token, stored once)")
    print(f"one snapshot takes {report['snapshot_s'] * 1e3:.2f} ms = "
          f"{report['snapshot_in_prefill_tokens']:.3f} prefill tokens")
    if report["sweep"]:
        print(f"{'every':>6} {'cold+snap/cold':>15} {'branched s':>11}")
        for row in report["sweep"]:
            print(f"{row['snapshot_every']:>6} {row['cold_snap_vs_cold']:>15.3f} "
                  f"{row['branched_s']:>11.4f}")
