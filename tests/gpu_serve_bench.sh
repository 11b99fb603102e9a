#!/usr/bin/env bash
# Issue 28's serve figures on the lent GPU machine (shared/device/README.md): serve's time to
# first token at 1k/4k/16k prompt tokens with the default flags (--speculative auto: the MTP
# head's rows in the GPU pass) and with --speculative none, against the GPU prefill alone, and 8
# concurrent 64-token prompts against one; medians of 3 interleaved fresh-process rounds
# (tests/fermijit/server/serve_bench.py). About 3 minutes. Logs and JSON go to OUT; the table
# is printed last. STEPS (default tests,bench): `tests` first runs the GPU tests of the prefill
# path it times (the Q8_0 LM head through kquant_gemm's Q8_0 GEMM, the hand-off into the
# server's page-locked GDN pool) and the server's pool tests, ~2-4 minutes with a cold kernel
# cache; run `bench` alone in a second command if the two together near the device's limit.
# `state` runs only the GPU tests of the states' way in and out (the prefill's, the pool's).
# Usage, from the project root, after shared/device/prepare.sh here:
#   bash tests/gpu_serve_bench.sh OUT [tests,state,bench]
set -u
out=${1:?usage: tests/gpu_serve_bench.sh OUTDIR [tests,bench]}
steps=${2:-tests,bench}
mkdir -p "$out"
source "$(dirname "$0")/gpu_install.sh"
case ",$steps," in *,tests,*)
  timeout 300 python3 -m pytest -q -rsP -p no:cacheprovider tests/ops/test_kquant_gemm_gpu.py \
    tests/fermijit/prefill/test_hybrid_gpu.py tests/fermijit/prefill/test_hybrid.py \
    tests/fermijit/server/test_state_pool.py >"$out/tests.log" 2>&1
  echo "GPU prefill + pool tests rc=$?"; grep -E "passed|failed|error" "$out/tests.log" | tail -1
  grep -E "^(FAILED|ERROR)|^E  " "$out/tests.log" | head -20;;
esac
case ",$steps," in *,state,*)  # the GPU tests of the states' way in and out alone
  timeout 240 python3 -m pytest -q -rsP -p no:cacheprovider \
    tests/fermijit/prefill/test_hybrid_gpu.py tests/fermijit/server/test_state_pool.py \
    >"$out/state-tests.log" 2>&1
  echo "GPU prefill state tests rc=$?"
  grep -E "passed|failed|error" "$out/state-tests.log" | tail -1
  grep -E "^(FAILED|ERROR)|^E  " "$out/state-tests.log" | head -20;;
esac
case ",$steps," in *,bench,*) ;; *) exit 0;; esac
full=/dev/shm/fermijit-reap128
[ -f $full/fermijit.json ] || python3 -m fermijit synth qwen3.6-35b-a3b-reap128 $full \
  >"$out/synth.txt" 2>&1
python3 -m tests.fermijit.server.serve_bench $full "$out" 2>"$out/serve-bench.log"
echo "serve bench rc=$?"
tail -5 "$out/serve-bench.log"
echo "the default servers' GPU prefill calls (--verbose): sequences, rows, phases"
grep -h "^gpu prefill of" "$out/serve-default.log"
echo "the scheduler's share of each 8-prompt batch (--verbose): before the call, after it"
grep -h "^serve: 8 prompt" "$out/serve-default.log"
# Where a warm start's seconds go (issue 28 item 4: <= 3 s): one more start with -X importtime,
# and one under cProfile (stopped by SIGINT once serving: uvicorn's clean exit writes the profile).
python3 -m tests.fermijit.server.start_profile $full "$out" 2>"$out/start-profile.log"
echo "start profile rc=$?"
tail -40 "$out/start-profile.txt"
