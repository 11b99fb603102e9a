#!/usr/bin/env bash
# Issue 28 item 4 on the lent GPU machine (shared/device/README.md): `serve`'s start, exec to
# "ready" <= 3 s with a warm kernel cache and the full-size synthetic reap128 model in the page
# cache (/dev/shm). STEPS (default tests,start):
#   tests  the GPU tests of the driver-API path, the GPU prefill against the CPU's and the
#          server's pool (what the start prepares), capped at 150 s;
#   start  the model synthesised (~16-30 s) unless there, then tests/fermijit/server/start_bench.py:
#          a first start (the kernel cache cold: compiled as it goes), then up to ROUNDS (5)
#          interleaved rounds of fresh starts in the modes below, each with a first and a second
#          64-token request, within what is left of TOTAL_S (330 s from this script's start:
#          rounds that would end past it are not begun, the table says how many ran).
# Modes (START_MODES to change; start_bench.py ENV says each one's environment, MODES the
# others: main, ahead0, early0, popwhole, nice0, regchunk64 ...): default (this branch: the
# model file mapped and registered with the driver from the early driver thread at exec),
# earlyreg0 (registered by the GPU's preparation after the load, as before), cpu (--prefill cpu).
# Read last: the short table, per mode the median "exec->ready" (the server's own "ready in",
# counted from the process's exec: the target), "Popen->serving" and "Popen->1st token" (the
# first request's first token), above them the phases (imports, load, kernels, the GPU's parts,
# "waited for the gpu": how long ready waited for the GPU's thread after the CPU kernels;
# "early registration" its seconds and "from" when it began after exec, "early chunks" and
# "adopted": how many chunks it registered and the GPU's preparation took over, equal where
# it worked), and
# the first (cold cache) start's line at the very end. Logs and JSON under OUT.
# Python files are byte-compiled first (a user's install has them so).
# Usage, from the project root, after shared/device/prepare.sh here:
#   bash tests/gpu_start_bench.sh OUT [tests,start]
set -u
began=$SECONDS
out=${1:?usage: tests/gpu_start_bench.sh OUTDIR [tests,start]}
steps=${2:-tests,start}
total_s=${TOTAL_S:-330}
mkdir -p "$out"
source "$(dirname "$0")/gpu_install.sh"
python3 -m compileall -q -j 0 /tmp/site fermijit model ops tests >/dev/null 2>&1
echo "installed and byte-compiled in $((SECONDS - began)) s"
case ",$steps," in *,tests,*)
  timeout 150 python3 -m pytest -q -rsP -p no:cacheprovider tests/fermijit/jit/test_gpu_driver.py \
    tests/fermijit/jit/test_gpu_early.py tests/fermijit/prefill/test_hybrid_gpu.py \
    tests/fermijit/server/test_state_pool.py \
    >"$out/tests.log" 2>&1
  echo "driver-API + GPU prefill + pool tests rc=$? ($((SECONDS - began)) s so far)"
  grep -E "passed|failed|error" "$out/tests.log" | tail -1
  grep -E "^(FAILED|ERROR)|^E  " "$out/tests.log" | head -20;;
esac
case ",$steps," in *,start,*) ;; *) exit 0;; esac
full=${START_MODEL:-/dev/shm/fermijit-reap128}  # START_MODEL: another (a smaller one, to try the script)
[ -f $full/fermijit.json ] || python3 -m fermijit synth qwen3.6-35b-a3b-reap128 $full \
  >"$out/synth.txt" 2>&1
cat $full/model.safetensors >/dev/null  # in the page cache (tmpfs: it is)
nodes=$(cat /sys/devices/system/node/online 2>/dev/null)  # >1: the early threads interleave
cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)  # the host's, stated with its figures
echo "model ready at $((SECONDS - began)) s; $(nproc) cores of${cpu}; NUMA nodes $nodes; $(uptime)"
left=$((total_s - (SECONDS - began) - 10))
# A kernel cache of its own, empty: the first start is a cold one (the tests step filled the
# default one), the rounds' are warm (filled by it).
export NUMBA_CACHE_DIR=$(mktemp -d /tmp/fermijit-start-cache.XXXXXX)
START_MODES=${START_MODES:-default,earlyreg0,cpu} START_IMPORTS=0 \
  timeout $((left + 30)) python3 -m tests.fermijit.server.start_bench $full "$out" ${ROUNDS:-5} $left \
  >"$out/start-table.txt" 2>"$out/start-bench.err"
echo "start bench rc=$? ($((SECONDS - began)) s in all)"; tail -3 "$out/start-bench.err"
grep -h "unavailable\|Traceback\|Error" "$out/start-bench.log" | sort | uniq -c | head -6
cat "$out/start-table.txt"
