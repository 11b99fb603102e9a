#!/usr/bin/env bash
# The GPU prefill's pass on the lent GPU machine (issue 10): its GPU tests, then bench prefill on
# the default model and on both synthetic full-size shapes within --gpu-mem 6G (models built in
# /dev/shm, never carried). Full logs in OUT; a summary printed last.
# Usage, from the project root, after shared/device/prepare.sh:
#   bash tests/gpu_hybrid.sh OUT [STEPS]
set -u
out=${1:?usage: tests/gpu_hybrid.sh OUTDIR [tests,default,sweep,reap128,ring128,full256]}
steps=${2:-tests,default,reap128,full256}
mkdir -p "$out"
source "$(dirname "$0")/gpu_install.sh"
case ",$steps," in *,tests,*)
  timeout 300 python3 -m pytest -q -rsP -p no:cacheprovider tests/ops/test_f32_gemm_gpu.py \
    tests/fermijit/prefill/test_hybrid_gpu.py tests/fermijit/prefill/test_hybrid.py \
    tests/model/test_reap_gpu.py >"$out/tests.log" 2>&1
  echo "hybrid tests rc=$?"; grep -E "passed|failed|error" "$out/tests.log" | tail -2
  grep -E "^(FAILED|ERROR)|^E  " "$out/tests.log" | head -20; grep -h "^rel err" "$out/tests.log";;
esac
bench() {  # NAME ARGS...: one bench prefill, its table last
  local name=$1; shift
  timeout 400 python3 -m fermijit bench prefill "$@" --verbose --project c2075 \
    >"$out/bench-$name.txt" 2>"$out/bench-$name.err"
  echo "bench $name rc=$?"; tail -3 "$out/bench-$name.err"
}
case ",$steps," in *,default,*) bench default --model fermijit/default_model --tokens 947;; esac
case ",$steps," in *,sweep,*)
  timeout 200 python3 -m fermijit bench prefill --model fermijit/default_model \
    --sweep 4,8,16,32,64,128,256 >"$out/sweep-default.txt" 2>"$out/sweep-default.err"
  echo "sweep default rc=$?"; cat "$out/sweep-default.txt";;
esac
case ",$steps," in *,reap128,*)
  bench reap128 --synthetic qwen3.6-35b-a3b-reap128 --tokens 947 --gpu-mem 6G;; esac
case ",$steps," in *,ring128,*)
  bench ring128 --synthetic qwen3.6-35b-a3b-reap128 --tokens 947 --gpu-mem 6G --pin-budget 1G;;
esac
case ",$steps," in *,sweep128,*)
  timeout 250 python3 -m fermijit bench prefill --synthetic qwen3.6-35b-a3b-reap128 \
    --sweep 8,32,128 >"$out/sweep-reap128.txt" 2>"$out/sweep-reap128.err"
  echo "sweep reap128 rc=$?"; cat "$out/sweep-reap128.txt"; tail -2 "$out/sweep-reap128.err";;
esac
case ",$steps," in *,full256,*)
  rm -rf /dev/shm/fermijit-synth-qwen3.6-35b-a3b-reap128
  bench full256 --synthetic qwen3.6-35b-a3b --tokens 947 --gpu-mem 6G;; esac
for f in "$out"/bench-*.txt; do echo "== $f"; grep -v "^  " "$f" | head -12; done
