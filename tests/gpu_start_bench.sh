#!/usr/bin/env bash
# Issue 28 item 4 on the lent GPU machine (shared/device/README.md): `serve`'s start with a warm
# kernel cache, the full-size synthetic reap128 model in the page cache (/dev/shm): a first start
# (filling the kernel cache), then 3 interleaved rounds of fresh starts in three modes (the
# GPU's preparation beside the CPU warm-up as `serve` does it, the same one after the other,
# --prefill cpu), each with the server's phases and a first and second 64-token request; last,
# the slowest imports (tests/fermijit/server/start_bench.py), and a probe of what registering
# the model file stalls. About 2-3 minutes with the model written. STEPS (default start):
# `tests` first runs the GPU tests of what the start prepares (the dense weights' upload, the
# hand-off's Q8_0 rounding in one launch a sequence: the GPU prefill's and the server pool's
# tests), ~2-4 minutes with a cold kernel cache: run it as a second command if the two near the
# device's limit.
# Usage, from the project root, after shared/device/prepare.sh here:
#   bash tests/gpu_start_bench.sh OUT [tests,start]
set -u
out=${1:?usage: tests/gpu_start_bench.sh OUTDIR [tests,start]}
steps=${2:-start}
mkdir -p "$out"
source "$(dirname "$0")/gpu_install.sh"
case ",$steps," in *,tests,*)
  timeout 280 python3 -m pytest -q -rsP -p no:cacheprovider tests/ops/test_act_quant_gpu.py \
    tests/fermijit/prefill/test_hybrid_gpu.py tests/fermijit/prefill/test_hybrid.py \
    tests/fermijit/server/test_state_pool.py >"$out/tests.log" 2>&1
  echo "GPU prefill + pool tests rc=$?"; grep -E "passed|failed|error" "$out/tests.log" | tail -1
  grep -E "^(FAILED|ERROR)|^E  " "$out/tests.log" | head -20;;
esac
case ",$steps," in *,start,*) ;; *) exit 0;; esac
full=/dev/shm/fermijit-reap128
[ -f $full/fermijit.json ] || python3 -m fermijit synth qwen3.6-35b-a3b-reap128 $full \
  >"$out/synth.txt" 2>&1
cat $full/model.safetensors >/dev/null  # in the page cache (tmpfs: it is)
nproc; uptime
timeout 400 python3 -m tests.fermijit.server.start_bench $full "$out" 3 2>"$out/start-bench.err"
echo "start bench rc=$?"; tail -3 "$out/start-bench.err"
grep -h "gpu prefill ready\|unavailable" "$out/start-bench.log" | head -4
# Does registering the model file (the experts' source) stall another thread's mmap (the
# memory-map lock) or its Python? The CPU kernels' loading maps memory as the GPU starts beside it.
timeout 60 python3 -m tests.fermijit.server.start_bench --probe $full 2>&1 | tail -2
