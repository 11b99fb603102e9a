#!/usr/bin/env bash
# Issue 31 item 4 on the GPU machine, one command of < 4 minutes: install (tests/gpu_install.sh),
# the flash-attention and chunked-GDN GPU tests, then `bench gpu` for those two kernels at 1k, 4k
# and 16k tokens (targets at 16k: flash attention >= 40 %, the chunked GDN >= 35 % of the FMA
# ceiling; the GDN's prep and scan are also timed apart). Full logs go to OUT; a short table is
# printed last, after the GDN kernels' registers and spills as ptxas reports them.
# Usage, from the project root: bash tests/gpu_kernels_bench.sh OUT
set -u
out=${1:?usage: tests/gpu_kernels_bench.sh OUTDIR}
mkdir -p "$out"
source "$(dirname "$0")/gpu_install.sh"
nvidia-smi -L >"$out/device.txt" 2>&1
timeout 100 python3 -m pytest -q -rsP -p no:cacheprovider tests/ops/test_attention_gpu.py \
  tests/ops/test_gated_delta_gpu.py >"$out/gpu-tests.log" 2>&1
echo "gpu tests rc=$?"
for n in 1024 4096 16384; do
  timeout 60 python3 -m fermijit bench gpu --tokens $n --only flash --only "gated delta" \
    >"$out/bench-$n.txt" 2>&1
  echo "bench gpu $n rc=$?"
done
grep -E "passed|failed|error" "$out/gpu-tests.log" | tail -3
grep -E "^(FAILED|ERROR)" "$out/gpu-tests.log" | head -20
echo "max relative errors (max|e-a|/max|e|) over the tested shapes:"
grep -h "^rel err " "$out/gpu-tests.log" | sed 's/^rel err //' \
  | awk -F': ' '{ if (!($1 in m) || $2 + 0 > m[$1] + 0) m[$1] = $2 } END { for (k in m) printf "%-28s %s\n", k, m[k] }' \
  | sort
timeout 60 python3 -m fermijit kernels check >"$out/kernels-check.txt" 2>&1
echo "kernels check rc=$? (gdn_chunk rows):"
grep -E "gdn_chunk" "$out/kernels-check.txt" | head -4
grep -h "FMA ceiling" "$out/bench-1024.txt"
for n in 1024 4096 16384; do grep -E "flash|gated delta" "$out/bench-$n.txt"; done
