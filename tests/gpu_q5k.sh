#!/usr/bin/env bash
# Issue 34, Q5_K on the GPU prefill (kernels_ptx/kquant_gemm.ptx FORMAT=q5_k), on the lent GPU
# machine, < 5 min: installs as tests/gpu_kquant.sh does, then ptxas conformance of the
# kquant_gemm variants (regs, spill bytes), the block GEMM tests (every format, Q5_K new: dense
# on ragged shapes, bit for bit, Q5_K_M expert pairs) against the numpy reference, the GPU
# prefill tests of tests/fermijit/prefill/test_kquant_gpu.py (the Q4_K_M models as before, and a
# Q5_K-requantised one against the all-CPU prefill), and the dense/expert K-quant GEMMs' speed
# (Q5_K beside Q4_K: what its 60 spilled bytes cost). Full logs in OUT; a short summary last.
# Usage, from the project root: bash tests/gpu_q5k.sh OUT
set -u
out=${1:?usage: tests/gpu_q5k.sh OUTDIR}
mkdir -p "$out"
source "$(dirname "$0")/gpu_install.sh"
nvidia-smi -L >"$out/device.txt" 2>&1
timeout 120 python3 -m fermijit kernels check >"$out/kernels-check.txt" 2>&1
echo "kernels check rc=$?"
timeout 270 python3 -m pytest -q -rsP -p no:cacheprovider tests/ops/test_kquant_gemm_gpu.py \
  tests/fermijit/prefill/test_kquant_gpu.py >"$out/q5k-tests.log" 2>&1
echo "kquant gpu tests rc=$?"
timeout 60 python3 - >"$out/gemm-speed.txt" 2>&1 <<'EOF'
import numpy as np
from fermijit.bench import gpu as b
fma, _ = b.fma_ceiling()
rng = np.random.default_rng(0)
for r in b.gemm_rows(rng, 1024, fma) + b.expert_rows(rng, 1024, fma):
    print(f"{r.kernel:<44} {r.shape:<22} {r.time_us:9.1f} us  {r.ceiling_fraction:6.1%} of FMA")
EOF
echo "gemm speed rc=$?"
echo "== tests"; grep -E "passed|failed|error" "$out/q5k-tests.log" | tail -1
grep -E "^(FAILED|ERROR)" "$out/q5k-tests.log" | head -20
echo "== kernels check (kquant_gemm: regs, spill bytes, smem):"
grep -E "kquant_gemm" "$out/kernels-check.txt"; tail -2 "$out/kernels-check.txt" | head -1
echo "== max relative errors (max|e-a|/max|e|) over the tested shapes:"
grep -h "^rel err " "$out/q5k-tests.log" | sed 's/^rel err //' \
  | awk -F': ' '{ if (!($1 in m) || $2 + 0 > m[$1] + 0) m[$1] = $2 } END { for (k in m) printf "%-48s %s\n", k, m[k] }' \
  | sort
echo "== K-quant GEMMs (T 1024):"
grep -E "gemm" "$out/gemm-speed.txt" | head -24
