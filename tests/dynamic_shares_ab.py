"""Issue 29: an in-process A/B of the chunked shares' schedules, the static equal runs (main's
splits) against claimed runs (jit.omp.first_run). One model and state; windows of W greedy
tokens alternate static | dynamic (the order swapped every pair), so the machine's drift hits
both; each window also counts its parallel regions (jit.omp.Regions: per token, the threads'
mean work, idle inside regions and fork/join). First checks that both schedules decode the same
greedy tokens from the same prompt. Prints one line per thread count (JSON with --json).
Usage: python tests/dynamic_shares_ab.py MODEL THREADS[,THREADS...] [PAIRS] [W] [--json]"""

import json
import os
import statistics as st
import sys
import time

# Run as a script from tests/: that folder first on the path would shadow the package (tests/fermijit).
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import numpy as np  # noqa: E402

from fermijit.jit import cpu, omp  # noqa: E402
from fermijit.model.forward import load_model  # noqa: E402

args = [a for a in sys.argv[1:] if a != "--json"]
model_dir, counts = args[0], [int(c) for c in args[1].split(",")]
pairs = int(args[2]) if len(args) > 2 else 8
w = int(args[3]) if len(args) > 3 else 6
_, model = load_model(model_dir)
prompt = np.random.default_rng(0).integers(0, 1000, 32).tolist()


def window(dynamic, token, state):
    omp.set_dynamic(dynamic)
    times, toks = [], []
    r0 = omp.Regions.now()
    for _ in range(w):
        t0 = time.perf_counter()
        token = int(np.argmax(model.decode(token, state)))
        times.append(time.perf_counter() - t0)
        toks.append(token)
    r = omp.Regions.now() - r0
    split = {"work": r.busy_mean_s, "idle": r.idle_s, "fork": r.fork_join_s}
    return st.median(times), {k: 1e3 * v / w for k, v in split.items()}, toks, token


def fresh():
    state = model.new_state(len(prompt) + 2 * (pairs + 1) * w + 4)
    return state, int(np.argmax(model.prefill(prompt, state)))


results = []
for n in counts:
    cpu.configure_threads(n)
    s1, t1 = fresh()
    s2, t2 = fresh()
    same = window(False, t1, s1)[2] == window(True, t2, s2)[2]
    state, token = fresh()
    window(True, token, state)  # warm
    omp.Regions.start()
    ms, splits, ratios = {False: [], True: []}, {False: [], True: []}, []
    for p in range(pairs):
        got = {}
        for dyn in ((False, True) if p % 2 == 0 else (True, False)):
            m, split, _, token = window(dyn, token, state)
            got[dyn] = m
            ms[dyn].append(1e3 * m)
            splits[dyn].append(split)
        ratios.append(got[False] / got[True])
    omp.Regions.stop()
    omp.set_dynamic(True)
    row = {"threads": n, "same_tokens": same, "static_ms": st.median(ms[False]),
           "dynamic_ms": st.median(ms[True]), "speedup": st.median(ratios), "pairs": ratios}
    for dyn, name in ((False, "static"), (True, "dynamic")):
        for k in ("work", "idle", "fork"):
            row[f"{name}_{k}_ms"] = st.median(s[k] for s in splits[dyn])
    results.append(row)
    if "--json" not in sys.argv:
        print(f"threads {n:3}: ms/token static {row['static_ms']:.2f} dynamic "
              f"{row['dynamic_ms']:.2f}, static/dynamic {row['speedup']:.3f} (paired windows, "
              f"{min(ratios):.3f}-{max(ratios):.3f}); per token work/idle/fork static "
              f"{row['static_work_ms']:.2f}/{row['static_idle_ms']:.2f}/"
              f"{row['static_fork_ms']:.2f}, dynamic {row['dynamic_work_ms']:.2f}/"
              f"{row['dynamic_idle_ms']:.2f}/{row['dynamic_fork_ms']:.2f}; same greedy tokens: "
              f"{'yes' if same else 'NO'}", flush=True)
if "--json" in sys.argv:
    print(json.dumps(results))
