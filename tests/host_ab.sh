#!/usr/bin/env bash
# Whole-token A/B on the GPU machine's 16-core host (issue 31 item 3): fresh-process rounds of
# tests/gpu_longctx.sh paired16k (decode at 16k positions against 64, 16 threads, 11 paired
# windows) of several project trees, taken in turn (A B A B ...) until LIMIT seconds (480), so
# every tree meets the host's noise alike. What attention alone cannot show (an op's effect on
# the others', e.g. the caches it leaves them) shows here. A tree: `base` (this checkout) or a
# folder holding another copy of the packages, made with
#   git archive <commit> fermijit ops model kernels_ptx | tar -x -C exp/NAME
# (less fermijit/default_model/model.safetensors: the working tree travels in 64 MiB), edited
# there; it runs from its folder, which puts its packages first on the path.
# Usage, from the project root: bash tests/host_ab.sh OUT base exp/NAME ...  (carry .device-wheels)
set -u
out=${1:?usage: tests/host_ab.sh OUT TREE...}; shift
mkdir -p "$out"
root=$PWD start=$SECONDS
[ -d .device-wheels ] && source "$(dirname "$0")/gpu_install.sh"
for i in 1 2 3 4 5 6; do
  for tree in "$@"; do
    [ $((SECONDS - start)) -gt "${LIMIT:-480}" ] && break 2
    dir=$root; [ "$tree" = base ] || dir=$root/$tree
    name=${tree//\//-}-$i
    (cd "$dir" && AB=0 bash "$root/tests/gpu_longctx.sh" "$out/$name" paired16k \
      >"$out/$name.txt" 2>&1)
    report=$(grep -h '^decode at' "$out/$name.txt" | head -1)
    echo "[$((SECONDS - start)) s] $tree, round $i: ${report:-no report}"
    # the ops that grew most from 64 positions (a profiled token at each)
    grep -v WARNING "$out/$name.txt" | grep -A7 "^op " | tail -n +2 | sed 's/^/    /'
  done
done
