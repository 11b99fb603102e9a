#!/usr/bin/env bash
# Issue 34 on the lent GPU machine: the K-quant GPU prefill's pass. Installs as tests/gpu_pass.sh
# does, then: ptxas conformance of every kernel (kernels check, the new kquant_gemm and
# act_quant_k variants listed), the block GEMM (Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, Q8_0) and Q8_K
# rounding tests against their numpy references, two Q4_K_M models' GPU prefill against the float64
# reference and the all-CPU run, a GGUF the GPU refuses falling back in one line, and the tiny
# Q4_0 model's GPU prefill tests (the code they share was reworked). Full logs in
# OUT; a short summary printed last. Usage, from the project root: bash tests/gpu_kquant.sh OUT
set -u
out=${1:?usage: tests/gpu_kquant.sh OUTDIR}
mkdir -p "$out"
source "$(dirname "$0")/gpu_install.sh"
nvidia-smi -L >"$out/device.txt" 2>&1
timeout 120 python3 -m fermijit kernels check >"$out/kernels-check.txt" 2>&1
echo "kernels check rc=$?"
timeout 240 python3 -m pytest -q -rsP -p no:cacheprovider tests/ops/test_kquant_gemm_gpu.py \
  tests/ops/test_act_quant_gpu.py tests/fermijit/prefill/test_kquant_gpu.py \
  "tests/model/test_kquant_model.py::test_gpu_prefill_of_a_k_quant_model_is_the_cpus_on_a_device" \
  >"$out/kquant-tests.log" 2>&1
echo "kquant gpu tests rc=$?"
timeout 240 python3 -m pytest -q -rsP -p no:cacheprovider tests/fermijit/prefill/test_hybrid_gpu.py \
  -k "tiny-e128" >"$out/q4_0-tests.log" 2>&1
echo "q4_0 gpu prefill tests (tiny-e128) rc=$?"
timeout 150 python3 -m fermijit bench gpu >"$out/bench-gpu.txt" 2>&1
echo "bench gpu rc=$?"
for log in kquant-tests q4_0-tests; do
  echo "== $log"; grep -E "passed|failed|error" "$out/$log.log" | tail -1
  grep -E "^(FAILED|ERROR)" "$out/$log.log" | head -20
done
echo "== kernels check (kquant_gemm, act_quant_k; regs, spill bytes, smem):"
grep -E "kquant_gemm|act_quant_k" "$out/kernels-check.txt"; tail -3 "$out/kernels-check.txt"
echo "== max relative errors (max|e-a|/max|e|) over the tested shapes:"
grep -h "^rel err " "$out/kquant-tests.log" "$out/q4_0-tests.log" | sed 's/^rel err //' \
  | awk -F': ' '{ if (!($1 in m) || $2 + 0 > m[$1] + 0) m[$1] = $2 } END { for (k in m) printf "%-48s %s\n", k, m[k] }' \
  | sort
echo "== W4A8 positions off by more than the tight bound:"
grep -h "positions off by more than" "$out/kquant-tests.log" "$out/q4_0-tests.log" | cut -c1-300
echo "== bench gpu: Q4_0 and K-quant GEMMs at the model's shapes:"
grep -E "gemm|kernel|FMA|ceiling" "$out/bench-gpu.txt" | head -24
