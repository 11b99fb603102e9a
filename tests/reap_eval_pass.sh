#!/usr/bin/env bash
# REAP's evaluation model (issue 36) at the `default` preset's size, for the GPU machine, in two
# commands of under 10 minutes: the first trains it with the real checkpoint's routing recipe
# (training/train.py --routing real: 256 experts, top-8, transformers' balancing loss at
# 0.001) on CUDA for MINUTES (default 7: as many of the preset's 3.5 epochs as fit) into /dev/shm
# and converts it; the second finds it there and runs `bench prune` at 25 % and 50 % on the host's
# CPU cores. train_log.json, the bench's table and JSON, and the logs go to OUT.
# Usage, from the project root, after shared/device/prepare.sh here, with the corpus in
# build/default_corpus (python -m training.corpus build/default_corpus; carry
# .device-wheels and build/default_corpus): bash tests/reap_eval_pass.sh OUT, then again.
# Elsewhere (a rehearsal): PYTHON=.venv/bin/python PRESET=tiny MINUTES=0.5 DATA=DIR
# MAX_TOKENS=4096 bash tests/reap_eval_pass.sh OUT (without .device-wheels nothing is installed).
set -u
out=${1:?usage: tests/reap_eval_pass.sh OUTDIR}
mkdir -p "$out"
start=$SECONDS
if [ -d .device-wheels ]; then source "$(dirname "$0")/gpu_install.sh"; fi
py=${PYTHON:-python3}
data=${DATA:-build/default_corpus}
hf=/dev/shm/fj-reapeval-hf
model=/dev/shm/fj-reapeval
if [ ! -f "$model/fermijit.json" ]; then
  rm -rf "$hf" "$model"
  $py -m training.train --data "$data" --out "$hf" --routing real \
    --preset "${PRESET:-default}" --minutes "${MINUTES:-7}" --evals 5 >"$out/train.log" 2>&1 \
    || { echo "training failed:"; tail -5 "$out/train.log"; exit 1; }
  cp "$hf/train_log.json" "$out/"
  $py -m fermijit convert "$hf" "$model" >"$out/convert.log" 2>&1 \
    || { echo "convert failed:"; tail -3 "$out/convert.log"; exit 1; }
  grep '"heldout"' "$out/train.log" | tail -1
  echo "trained and converted in $((SECONDS - start)) s: run the same command again for the bench"
  exit 0
fi
bench() {  # the table to OUT/bench-prune.txt, or with --json the JSON to OUT/bench-prune.json
  $py -m fermijit bench prune --model "$model" --text "$data/train.txt" \
    --heldout "$data/heldout.txt" --ratio 0.25 --ratio 0.5 --max-tokens "${MAX_TOKENS:-65536}" \
    ${CTX:+--ctx "$CTX"} "$@"
}
bench --json >"$out/bench-prune.json" 2>"$out/bench-prune.log" || { echo "bench failed:";
  tail -3 "$out/bench-prune.log"; exit 1; }
# The table from the JSON (the run above; not a second bench).
$py - "$out/bench-prune.json" <<'EOF' | tee "$out/bench-prune.txt"
import json, sys
r = json.load(open(sys.argv[1]))
print(f"calibration {r['calibration']['n_tokens']} tokens; held-out {r['heldout_tokens']} tokens")
print(f"{'model':<10} {'experts':>7} {'perplexity':>10} {'change':>8} {'dropped slots':>13}")
for row in r["rows"]:
    print(f"{row['model']:<10} {row['experts']:>7} {row['perplexity']:>10.3f} "
          f"{row['change']:>+8.2%} {row['dropped_share']:>13.2%}")
print(f"{'layer':>5} {'effective experts':>17} {'saliency cv':>11} {'rank corr':>9}")
for i, layer in enumerate(r["layers"]):
    print(f"{i:>5} {layer['effective_experts']:>17.1f} {layer['saliency_cv']:>11.3f} "
          f"{layer['rank_corr']:>9.3f}")
EOF
echo "wall: $((SECONDS - start)) s"
