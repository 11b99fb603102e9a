#!/usr/bin/env bash
# Issue 28 item 4 on the lent GPU machine (shared/device/README.md): `serve`'s start with a warm
# kernel cache, the full-size synthetic reap128 model in the page cache (/dev/shm): a first start
# (filling the kernel cache), then 3 interleaved rounds of fresh starts in three modes
# (tests/fermijit/server/start_bench.py): default (the GPU's start through the driver API
# releasing the GIL, experts registered on 4 threads, a 0.2 ms switch interval during the start,
# the hand-off room and GDN pool made before ready), pycuda (the same start the way it was:
# pycuda's module loads and page-locking, one registering thread, Python's 5 ms interval) and
# --prefill cpu; each with the server's phases and a first and second 64-token request (their
# GPU passes phase by phase); last, the slowest imports, and probes of what registering the
# model file stalls and of registering it on 1-8 threads. STEPS (default tests,start): `tests`
# first runs the GPU tests of the driver-API path (both ways' bits, a module load beside a
# counting thread) and of what the start prepares (the GPU prefill against the CPU's, the
# server pool's), at most 150 s. Python files are byte-compiled first
# (a user's install has them so; PYTHONDONTWRITEBYTECODE=1 here recompiled every module at
# every start). About 3-4 minutes in all with the model written.
# Usage, from the project root, after shared/device/prepare.sh here:
#   bash tests/gpu_start_bench.sh OUT [tests,start]
set -u
out=${1:?usage: tests/gpu_start_bench.sh OUTDIR [tests,start]}
steps=${2:-tests,start}
mkdir -p "$out"
source "$(dirname "$0")/gpu_install.sh"
echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset}; byte-compiling"
python3 -m compileall -q -j 0 /tmp/site fermijit model ops >/dev/null 2>&1
case ",$steps," in *,tests,*)
  timeout 150 python3 -m pytest -q -rsP -p no:cacheprovider tests/fermijit/jit/test_gpu_driver.py \
    tests/fermijit/prefill/test_hybrid_gpu.py tests/fermijit/server/test_state_pool.py \
    >"$out/tests.log" 2>&1
  echo "driver-API + GPU prefill + pool tests rc=$?"
  grep -E "passed|failed|error" "$out/tests.log" | tail -1
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
grep -h "gpu prefill ready\|unavailable\|Traceback\|Error" "$out/start-bench.log" | head -6
# Does registering the model file (the experts' source) stall another thread's mmap (the
# memory-map lock) or its Python? The CPU kernels' loading maps memory as the GPU starts beside it.
timeout 90 python3 -m tests.fermijit.server.start_bench --probe $full 2>&1 | tail -3
