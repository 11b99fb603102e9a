#!/usr/bin/env bash
# Issue 32 item 4 (a 2-row verify step <= 1.35x a token, full-size reap128), at 16 threads on the
# GPU machine's host, in one command of < 200 s: `bench decode --speculative mtp` in 3 fresh
# processes (verify_of_decode: the verify step timed with its rollback to the first row, against
# a token; the split of both steps by plan label), then tests/verify_rows_probe.py: the verify
# step's parts against a token's, each cold (every layer's weights in turn), medians of
# interleaved rounds: the GDN layers (a token's step vs the 2 rows; cold, and one layer's state in
# cache: the rows' compute alone), the fused MoE (1 token vs 2
# through the union launch vs 2 through main's kernel, random routing and half the experts
# shared, with the union's size and byte ratio), the residual steps, the few-token products and
# the Q8_0 LM head. A table last.
# Usage, from the project root: bash tests/verify_pass.sh OUT   (carry .device-wheels)
# Settings: MODEL (default /dev/shm/fermijit-reap128; synthesised there if absent, ~1 min), THREADS
# (default 16), PYTHON (default python3), ROUNDS (bench rounds, default 3).
set -u
out=${1:?usage: tests/verify_pass.sh OUTDIR}
mkdir -p "$out"
start=$SECONDS
if [ -d .device-wheels ]; then source "$(dirname "$0")/gpu_install.sh"; fi
py=${PYTHON:-python3}
model=${MODEL:-/dev/shm/fermijit-reap128}
threads=${THREADS:-16}
log="$out/verify.log"
step() { echo "[$((SECONDS - start)) s] $*" | tee -a "$log"; }
{ lscpu | head -20; free -g; uptime; git log --oneline -1 2>/dev/null; } >>"$log" 2>&1
[ -f "$model/fermijit.json" ] || $py -m fermijit synth qwen3.6-35b-a3b-reap128 "$model" >>"$log" 2>&1
step "model ready ($model), threads $threads"
# compiles into the cache (a machine whose cache is cold: a few minutes more than the < 4 above)
timeout 300 $py -m fermijit bench decode --model "$model" --speculative mtp --prompts 1 \
  --prompt-tokens 8 --tokens 4 --threads "$threads" >>"$log" 2>&1 || step "warm-up failed"
step "kernels compiled"
for r in $(seq 1 "${ROUNDS:-3}"); do
  timeout 100 $py -m fermijit bench decode --model "$model" --speculative mtp --prompts 1 \
    --prompt-tokens 32 --tokens 16 --threads "$threads" --json >"$out/spec-r$r.json" 2>>"$log" \
    || step "bench round $r failed"
  step "bench round $r done ($(uptime | sed 's/.*load/load/'))"
done
timeout 100 $py -m tests.verify_rows_probe "$model" "$threads" >"$out/probes.txt" 2>>"$log" \
  || step "probes failed"
step "probes done"
$py - "$out" <<'EOF' | tee -a "$log"
import glob, json, statistics, sys
from pathlib import Path

out = Path(sys.argv[1])
runs = [json.loads(Path(f).read_text()) for f in sorted(glob.glob(f"{out}/spec-r*.json"))]
runs = [r for r in runs if "costs" in r]
if runs:
    print("split, ms (median of the rounds' best): token / verify / ratio")
    # a token's step and the verify step's rows of the same part in one line
    same = {"gdn_rows.cpu": "gdn_step.cpu", "residual_rows.cpu": "residual_step.cpu"}
    for r in runs:
        split = {}
        for l, (d, v) in r.get("split", {}).items():
            row = split.setdefault(same.get(l, l), [0.0, 0.0])
            row[0] += d
            row[1] += v
        r["split"] = split
    labels = {l for r in runs for l in r["split"]}
    rows = []
    for l in labels:
        d = statistics.median(r["split"].get(l, [0, 0])[0] for r in runs)
        v = statistics.median(r["split"].get(l, [0, 0])[1] for r in runs)
        rows.append((max(d, v), l, d, v))
    for _, l, d, v in sorted(rows, reverse=True):
        print(f"  {l:<28} {d:7.2f} {v:7.2f} {v / d if d else float('nan'):6.2f}")
    print((Path(out) / "probes.txt").read_text() if (Path(out) / "probes.txt").exists() else "")
    for r in runs:
        c = r["costs"]
        print(f"round: token {c['decode_ms']:.2f} ms, verify {c['verify_ms']:.2f} ms, "
              f"verify/token {r['verify_of_decode']:.3f}, identical {r['identical_text']}, "
              f"load {r['load_1min']}")
    print(f"verify/token median {statistics.median(r['verify_of_decode'] for r in runs):.3f} "
          f"(target <= 1.35)")
EOF
step "done"
