#!/usr/bin/env bash
# Issue 29 item 2, prefill at 16 threads: the CPU prefill's GEMMs (ops/gemm.py, the dense product
# and the grouped experts) as the static split (FERMIJIT_PREFILL_CLAIM=0, as before) against
# claimed fine units (the default), on the full-size REAP-128 model in /dev/shm. ~3-4 min on the
# 16-core host:   bash tests/prefill_shares_pass.sh $OUT   (carry .device-wheels where needed)
# 1. the model synthesised into $MODEL if not there (~20 s); one short run compiles the kernels;
# 2. ROUNDS (3) interleaved fresh-process rounds, static then claimed, of `bench decode --threads
# $THREADS --prompt-tokens 512 --profile --json` (few decode tokens: the prefill is measured);
# 3. while BUDGET (240 s) allows, the claimed-vs-static bit-identity tests on the whole team.
# Prints last, per mode: medians of prefill tok/s and of "prefill of GEMM" (target >= 0.6 and
# >= 256 tok/s at 16 threads), the same run's GEMM GFLOP/s, and the profiled prefill's split
# (work / idle / fork ms; the GEMMs' idle apart). Env: MODEL, THREADS, PROMPT (512), TOKENS (8),
# ROUNDS, BUDGET, LAYERS (synthesise only N layers: a quick check of this script elsewhere).
set -u
out=${1:?usage: tests/prefill_shares_pass.sh OUTDIR}
mkdir -p "$out"
if [ -d .device-wheels ]; then source tests/gpu_install.sh; fi
py=${PYTHON:-python3}
model=${MODEL:-/dev/shm/fermijit-reap128}
rounds=${ROUNDS:-3}
budget=${BUDGET:-240}
prompt=${PROMPT:-512}
tokens=${TOKENS:-8}
start=$SECONDS
log="$out/prefill29.log"
step() { echo "[$((SECONDS - start)) s] $*" | tee -a "$log"; }
left() { echo $(( budget - (SECONDS - start) )); }
cores=$($py -c "import os; print(len(os.sched_getaffinity(0)))")
threads=${THREADS:-$(( cores < 16 ? cores : 16 ))}
if [ ! -f "$model/fermijit.json" ]; then
  $py -m fermijit synth qwen3.6-35b-a3b-reap128 "$model" ${LAYERS:+--layers "$LAYERS"} \
    >>"$log" 2>&1 || { step "synth failed (see $log)"; exit 1; }
  step "synthesised $model"
fi
timeout "$(left)" $py -m fermijit bench decode --model "$model" --threads "$threads" \
  --prompt-tokens 40 --tokens 2 >>"$log" 2>&1
step "kernels compiled ($cores cpus, $threads threads)"
for r in $(seq "$rounds"); do
  for mode in static claimed; do
    claim=1; [ $mode = static ] && claim=0
    [ "$(left)" -gt 20 ] || { step "budget spent before $mode $r"; break 2; }
    FERMIJIT_PREFILL_CLAIM=$claim timeout "$(left)" $py -m fermijit bench decode \
      --model "$model" --threads "$threads" --prompt-tokens "$prompt" --tokens "$tokens" \
      --profile --json >"$out/$mode-$r.json" 2>>"$log" || step "$mode $r failed"
    step "$mode round $r"
  done
done
tests="not run (budget)"
if [ "$(left)" -gt 30 ]; then
  NUMBA_NUM_THREADS=$threads timeout "$(left)" $py -m pytest -q -p no:cacheprovider \
    tests/ops/test_gemm.py -k claimed >"$out/tests.log" 2>&1 \
    && tests=passed || tests="FAILED or cut by the budget (tests.log)"
  step "tests $tests"
fi
$py - "$out" "$tests" <<'PY'
import glob, json, statistics as st, sys
out, tests = sys.argv[1], sys.argv[2]
GEMM_OPS = ("moe.cpu", "matvec.product")
print("mode     rounds  prefill tok/s  of GEMM %  GEMM dense / expert GFLOP/s | profiled prefill "
      "ms: total python prange work idle fork (GEMM ops' idle)")
for mode in ("static", "claimed"):
    runs = []
    for f in sorted(glob.glob(f"{out}/{mode}-*.json")):
        try:
            runs.append(json.load(open(f)))
        except ValueError:
            pass
    if not runs:
        print(f"{mode:8} no runs")
        continue
    med = lambda f: st.median(f(d) for d in runs)

    def total(d, key):  # the profiled prefill's "token" row (the whole pass)
        row = [r for r in d.get("prefill_profile") or [] if r["op"] == "token"] or [{}]
        return row[0].get(key, row[0].get("split", {}).get(key, float("nan")))

    def idle(d, ops):
        return sum(r["split"]["idle"] for r in d.get("prefill_profile") or []
                   if r.get("split") and r["op"] in ops)

    print(f"{mode:8} {len(runs):6} {med(lambda d: d['prefill_tok_s']):14.1f} "
          f"{100 * med(lambda d: d['prefill_of_gemm']):10.1f} "
          f"{med(lambda d: d['gemm_gflops']['dense']):11.1f} / "
          f"{med(lambda d: d['gemm_gflops']['expert']):6.1f}      | "
          + " ".join(f"{med(lambda d: total(d, k)):5.0f}" for k in
                     ("ms", "python_ms", "prange", "work", "idle", "fork_join"))
          + f" ({med(lambda d: idle(d, GEMM_OPS)):.0f})")
    print(f"         each round: tok/s {[round(d['prefill_tok_s'], 1) for d in runs]}, of GEMM "
          f"{[round(100 * d['prefill_of_gemm'], 1) for d in runs]}")
print(f"claimed-vs-static bit-identity tests on the whole team: {tests}")
PY
