#!/usr/bin/env bash
# Issue 29, dynamic shares: the chunked shares' static equal runs (FERMIJIT_STATIC_SHARES=1, or
# omp.set_dynamic(False); the default below omp.CLAIMS_FROM_TEAM threads) against claimed runs
# (FERMIJIT_CLAIMS_FROM_TEAM=1: in every team), on the full-size
# REAP-128 model in /dev/shm/fj-reap128 (made by tests/manycore_pass.sh with KEEP=1, or `python
# -m fermijit synth qwen3.6-35b-a3b-reap128 /dev/shm/fj-reap128` first). ~3-4 min on the 16-core
# host:   bash tests/dynamic_shares_pass.sh $OUT   (carry .device-wheels where the host needs them)
# 1. the chunked shares' tests on the whole team (every unit once; every output the one-thread
# bits); 2. tests/dynamic_shares_ab.py at half and all of 16 threads: one process, paired token
# windows alternating the schedules (ms a token, ratio, work/idle/fork per token, same greedy
# tokens); 3. ROUNDS (2) fresh-process rounds of `bench decode --threads-sweep` per schedule,
# interleaved. Prints last: per schedule and thread count the medians of tok/s, of the ceiling
# (paired with the probe) and a profiled token's split (work / idle / fork ms), the idle per op.
# Note: with claimed runs a thread that wakes late takes fewer runs, so its wake-up shows as
# "idle" (the longest share minus the mean) instead of fork/join: compare idle + fork.
set -u
out=${1:?usage: tests/dynamic_shares_pass.sh OUTDIR}
mkdir -p "$out"
if [ -d .device-wheels ]; then source tests/gpu_install.sh; fi
py=${PYTHON:-python3}
model=${MODEL:-/dev/shm/fj-reap128}
rounds=${ROUNDS:-2}
start=$SECONDS
log="$out/balance29.log"
step() { echo "[$((SECONDS - start)) s] $*" | tee -a "$log"; }
cores=$($py -c "import os; print(len(os.sched_getaffinity(0)))")
top=$(( cores < 16 ? cores : 16 ))
half=$(( top / 2 > 0 ? top / 2 : 1 ))
[ -f "$model/fermijit.json" ] || { echo "no model at $model"; exit 1; }
$py -m fermijit bench decode --model "$model" --prompt-tokens 8 --tokens 2 >>"$log" 2>&1
step "kernels compiled ($cores cpus)"
# The chunked shares' tests on this host's whole team (and 5 threads in a child).
NUMBA_NUM_THREADS=$top timeout 120 $py -m pytest -q -p no:cacheprovider \
  tests/fermijit/jit/test_omp.py \
  -k chunked >"$out/tests.log" 2>&1 && tests=passed || tests="FAILED (tests.log)"
step "tests $tests"
schedules=${SCHEDULES:-static,2:32:50,2:32:0,2:32:75,1:128:50,4:32:50,2:128:50}
timeout 200 $py tests/dynamic_shares_ab.py "$model" "$half,$top" 8 4 "$schedules" \
  >"$out/ab.txt" 2>>"$log" \
  || step "in-process A/B failed"
step "in-process A/B done"
for r in $(seq "$rounds"); do
  for side in static dynamic; do
    flag=0; [ $side = static ] && flag=1
    # claimed: in every team (the default claims from CLAIMS_FROM_TEAM threads only)
    FERMIJIT_STATIC_SHARES=$flag FERMIJIT_CLAIMS_FROM_TEAM=1 timeout 240 $py -m fermijit bench decode --model "$model" \
      --threads "$top" --prompt-tokens 16 --tokens 16 --profile --threads-sweep "$half,$top" \
      --json >"$out/$side-$r.json" 2>>"$log" || step "$side $r failed"
    step "$side round $r"
  done
done
$py - "$out" "$tests" <<'PY'
import glob, json, statistics as st, sys
out, tests = sys.argv[1], sys.argv[2]
runs = {}
for side in ("static", "dynamic"):
    for f in sorted(glob.glob(f"{out}/{side}-*.json")):
        try:
            runs.setdefault(side, []).append(json.load(open(f)))
        except ValueError:
            pass
print("schedule threads  tok/s  paired%   work   idle   fork   (medians of rounds: tok/s each)")
for side, ds in runs.items():
    counts = sorted({r["threads"] for d in ds for r in d.get("sweep") or []})
    for n in counts:
        rows = [r for d in ds for r in d.get("sweep") or [] if r["threads"] == n]
        med = lambda f: st.median(f(r) for r in rows)
        print(f"{side:8} {n:7} {med(lambda r: r['tok_s']):6.2f} "
              f"{100 * med(lambda r: r['of_ceiling_paired']):7.1f} "
              f"{med(lambda r: r['split']['work']):6.2f} {med(lambda r: r['split']['idle']):6.2f} "
              f"{med(lambda r: r['split']['fork_join']):6.2f}   "
              f"{[round(r['tok_s'], 2) for r in rows]}")
print("idle ms per op, one profiled token at the main run's threads (median of rounds):")
for side, ds in runs.items():
    ops = {}
    for d in ds:
        for p in d.get("profile") or []:
            if p.get("split"):
                ops.setdefault(p["op"][:40], []).append((p["split"]["work"], p["split"]["idle"]))
    for op, v in ops.items():
        print(f"  {side:8} {op:40} work {st.median(a for a, _ in v):6.2f} "
              f"idle {st.median(b for _, b in v):6.2f}")
print(f"chunked shares tests: {tests}")
PY
echo "in-process A/B (4-token windows round the schedules, 8 rounds; GUIDE:CHUNK_KB:STATIC_%):"
cat "$out/ab.txt"
