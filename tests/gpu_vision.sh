#!/usr/bin/env bash
# The vision tower's GPU pass in one command, for the lent GPU machine (see tests/gpu_pass.sh):
# install, the vision GPU tests (kernels against references, GPU tower against CPU tower),
# `bench vision` (CPU and GPU, full-size tower) and `generate --image --prefill gpu` on the tiny
# VLM. Full logs go to OUT; a short summary is printed last.
# Usage, from the project root: bash tests/gpu_vision.sh OUT
set -u
out=${1:?usage: tests/gpu_vision.sh OUTDIR}
mkdir -p "$out"
source "$(dirname "$0")/gpu_install.sh"
nvidia-smi -L
timeout 240 python3 -m pytest -q -rsP -p no:cacheprovider tests/ops/test_vision_gpu.py >"$out/vision-gpu-tests.log" 2>&1
echo "vision gpu tests rc=$?"
timeout 200 python3 -m fermijit bench vision --repeat 2 >"$out/bench-vision.txt" 2>&1
echo "bench vision rc=$?"
python3 - "$out" >"$out/generate.log" 2>&1 <<'PY'
import sys
from pathlib import Path
from tests.model import vision_oracle as vo
root = Path(sys.argv[1])
vo.write_model(root / "vlm")
vo.images()[0].save(root / "image.png")
PY
timeout 120 python3 -m fermijit generate --model "$out/vlm" --image "$out/image.png" --prefill gpu \
  --temperature 0 --max-tokens 8 "the cat" >>"$out/generate.log" 2>&1
echo "generate --image --prefill gpu rc=$?"
rm -rf "$out/vlm" "$out/image.png"
grep -E "passed|failed|error" "$out/vision-gpu-tests.log" | tail -3
grep -E "^(FAILED|ERROR)" "$out/vision-gpu-tests.log" | head -20
grep -h "^rel err " "$out/vision-gpu-tests.log" | sort | uniq
cat "$out/bench-vision.txt"
tail -4 "$out/generate.log"
