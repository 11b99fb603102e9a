#!/usr/bin/env bash
# The CPU-host targets measured on the GPU machine's 16 cores, in one device call (< 560 s, one
# cold start instead of three): issue 32 item 4 (tests/verify_pass.sh: the 2-row verify step
# against a token, 16 threads), issue 31 item 3 (tests/gpu_longctx.sh paired16k: decode at 16k
# positions against 64), then decode attention at 16k by stage at 16 threads and at 1
# (gpu_longctx.sh attn-stages), in the time left. Each part's summary is printed as it ends;
# logs under OUT/verify and OUT/long.
# Usage, from the project root: bash tests/host_pass.sh OUT   (carry .device-wheels)
set -u
out=${1:?usage: tests/host_pass.sh OUTDIR}
mkdir -p "$out"
start=$SECONDS
bash "$(dirname "$0")/verify_pass.sh" "$out/verify" >"$out/verify.txt" 2>&1
echo "[$((SECONDS - start)) s] verify_pass rc=$?"; tail -25 "$out/verify.txt"
bash "$(dirname "$0")/gpu_longctx.sh" "$out/long" paired16k >"$out/paired16k.txt" 2>&1
echo "[$((SECONDS - start)) s] paired16k rc=$?"; tail -20 "$out/paired16k.txt"
left=$((550 - (SECONDS - start)))
if [ "$left" -ge 60 ]; then
  STAGE_S=$((left / 2)) bash "$(dirname "$0")/gpu_longctx.sh" "$out/long" attn-stages \
    >"$out/stages.txt" 2>&1
  echo "[$((SECONDS - start)) s] attn-stages rc=$?"; cat "$out/stages.txt"
else
  echo "no time left for attn-stages"
fi
