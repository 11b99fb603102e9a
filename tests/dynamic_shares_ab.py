"""Issue 29: an in-process A/B of the chunked shares' schedules: the static equal runs (main's
splits) against claimed runs (jit.omp.first_run) of given GUIDE, CHUNK_BYTES and STATIC_PERCENT.
One model and state; windows of W greedy tokens go round the schedules (the order rotated every
round), so the machine's drift hits all; each window also counts its parallel regions
(jit.omp.Regions: per token, the threads' mean work, idle inside regions and fork/join). First
checks that every schedule decodes the same greedy tokens from the same prompt. One line per
thread count and schedule (JSON with --json).
Usage: python tests/dynamic_shares_ab.py MODEL THREADS[,THREADS...] [ROUNDS] [W] [SCHEDULES]
  SCHEDULES: comma-separated, `static` or GUIDE:CHUNK_KB[:STATIC_PERCENT] (default
  static,2:32:50, jit/omp.py's defaults)"""

import json
import os
import statistics as st
import sys
import time

# Run as a script from tests/: that folder first on the path would shadow the package
# (tests/fermijit).
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import numpy as np  # noqa: E402

from fermijit.jit import cpu, omp  # noqa: E402
from fermijit.model.forward import load_model  # noqa: E402

args = [a for a in sys.argv[1:] if a != "--json"]
model_dir, counts = args[0], [int(c) for c in args[1].split(",")]
rounds = int(args[2]) if len(args) > 2 else 8
w = int(args[3]) if len(args) > 3 else 6
names = (args[4] if len(args) > 4 else "static,2:32:50").split(",")
_, model = load_model(model_dir)
prompt = np.random.default_rng(0).integers(0, 1000, 32).tolist()


def use(name):
    if name == "static":
        omp.set_dynamic(False)
    else:
        guide, kb, *percent = name.split(":")
        omp.set_dynamic(True, int(guide), int(kb) << 10, int(percent[0]) if percent else None,
                        from_team=1)  # claimed at every team, CLAIMS_FROM_TEAM's too


def window(name, token, state):
    use(name)
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
    state = model.new_state(len(prompt) + (len(names) * rounds + 2) * w + 4)
    return state, int(np.argmax(model.prefill(prompt, state)))


default = omp.set_dynamic(True)
results = []
for n in counts:
    cpu.configure_threads(n)
    toks = []
    for name in names:
        s, t = fresh()
        toks.append(window(name, t, s)[2])
    same = all(t == toks[0] for t in toks)
    state, token = fresh()
    window(names[-1], token, state)  # warm
    omp.Regions.start()
    ms = {name: [] for name in names}
    splits = {name: [] for name in names}
    ratios = {name: [] for name in names}
    for r in range(rounds):
        got = {}
        for name in names[r % len(names):] + names[:r % len(names)]:
            m, split, _, token = window(name, token, state)
            got[name] = m
            ms[name].append(1e3 * m)
            splits[name].append(split)
        for name in names:
            ratios[name].append(got[names[0]] / got[name])
    omp.Regions.stop()
    for name in names:
        row = {"threads": n, "schedule": name, "same_tokens": same, "ms": st.median(ms[name]),
               "vs_first": st.median(ratios[name]), "ratios": ratios[name]}
        for k in ("work", "idle", "fork"):
            row[f"{k}_ms"] = st.median(s[k] for s in splits[name])
        results.append(row)
        if "--json" not in sys.argv:
            print(f"threads {n:3} {name:>7}: {row['ms']:7.2f} ms/token, {names[0]}/this "
                  f"{row['vs_first']:.3f} (paired windows {min(ratios[name]):.3f}-"
                  f"{max(ratios[name]):.3f}); per token work {row['work_ms']:.2f} idle "
                  f"{row['idle_ms']:.2f} fork {row['fork_ms']:.2f}; same greedy tokens: "
                  f"{'yes' if same else 'NO'}", flush=True)
omp.set_dynamic(*default)
if "--json" in sys.argv:
    print(json.dumps(results))
