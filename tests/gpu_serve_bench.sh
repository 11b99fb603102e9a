#!/usr/bin/env bash
# Issue 28's serve figures on the lent GPU machine (shared/device/README.md): serve's time to
# first token at 1k/4k/16k prompt tokens with the default flags (--speculative auto: the MTP
# head's rows in the GPU pass) and with --speculative none, against the GPU prefill alone, and 8
# concurrent 64-token prompts against one; medians of 3 interleaved fresh-process rounds
# (tests/fermijit/server/serve_bench.py). About 3 minutes. Logs and JSON go to OUT; the table
# is printed last.
# Usage, from the project root, after shared/device/prepare.sh here: bash tests/gpu_serve_bench.sh OUT
set -u
out=${1:?usage: tests/gpu_serve_bench.sh OUTDIR}
mkdir -p "$out"
source "$(dirname "$0")/gpu_install.sh"
full=/dev/shm/fermijit-reap128
[ -f $full/fermijit.json ] || python3 -m fermijit synth qwen3.6-35b-a3b-reap128 $full \
  >"$out/synth.txt" 2>&1
python3 -m tests.fermijit.server.serve_bench $full "$out" 2>"$out/serve-bench.log"
echo "serve bench rc=$?"
tail -5 "$out/serve-bench.log"
echo "the default servers' GPU prefill calls (--verbose): sequences, rows, phases"
grep -h "^gpu prefill of" "$out/serve-default.log"
# Where a warm start's seconds go (issue 28 item 4: <= 3 s): one more start with -X importtime,
# and one under cProfile (stopped by SIGINT once serving: uvicorn's clean exit writes the profile).
python3 -m tests.fermijit.server.start_profile $full "$out" 2>"$out/start-profile.log"
echo "start profile rc=$?"
tail -40 "$out/start-profile.txt"
