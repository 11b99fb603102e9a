#!/usr/bin/env bash
# Fresh-process interleaved rounds at 2 threads on the full-size model (under the full-size lock):
# main (/work/main, its venv), this branch (dynamic shares) and this branch with static shares.
# Usage: bash dev/ab_local.sh OUTDIR ROUNDS
set -u
out=${1:?outdir}; rounds=${2:-3}; mkdir -p "$out"
model=/tmp/fj-reap128
args="bench decode --model $model --threads 2 --prompt-tokens 64 --tokens 32 --profile --json"
for r in $(seq "$rounds"); do
  for side in main dyn static; do
    case $side in
      main) dir=/work/main; env=();;
      dyn) dir=/work/wt/balance29; env=();;
      static) dir=/work/wt/balance29; env=(FERMIJIT_STATIC_SHARES=1);;
    esac
    echo "round $r $side $(uptime)" >> "$out/log"
    (cd "$dir" && env "${env[@]}" timeout 600 flock /tmp/fullsize.lock .venv/bin/python -m fermijit $args \
      > "$out/$side-$r.json" 2>>"$out/log")
  done
done
python3 - "$out" <<'PY'
import json, sys, glob, statistics as st
out = sys.argv[1]
for side in ("main", "dyn", "static"):
    rows = []
    for f in sorted(glob.glob(f"{out}/{side}-*.json")):
        try:
            d = json.load(open(f))
        except ValueError:
            continue
        tok = [p for p in d["profile"] if p["op"] == "token"] if d.get("profile") else []
        s = tok[0]["split"] if tok and "split" in tok[0] else {}
        rows.append((d["decode_tok_s"], d["of_ceiling_paired"], s.get("idle"), s.get("fork_join")))
    print(side, "tok/s", [round(r[0], 2) for r in rows], "median", round(st.median(r[0] for r in rows), 2),
          "| paired %", [round(100 * r[1], 1) for r in rows], "median",
          round(100 * st.median(r[1] for r in rows), 1), "| idle ms", [r[2] and round(r[2], 2) for r in rows])
PY
