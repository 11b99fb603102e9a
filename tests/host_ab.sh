#!/usr/bin/env bash
# Fresh-process rounds of tests/gpu_longctx.sh paired16k (issue 31 item 3: decode at 16k
# positions against 64, 16 threads, 11 paired windows) on the GPU machine's 16-core host, of one
# or several project trees taken in turn (A B A B ...), ROUNDS (6) each or until LIMIT seconds
# (480), so every tree meets the host's noise alike; then each tree's median of its rounds'
# medians (the target: >= 85 %). What attention alone cannot show (an op's effect on the others',
# e.g. the caches it leaves them) shows here. A tree: `base` (this checkout) or a folder holding
# another copy of the packages, made with
#   git archive <commit> fermijit ops model kernels_ptx | tar -x -C exp/NAME
# (less fermijit/default_model/model.safetensors: the working tree travels in 64 MiB), edited
# there; it runs from its folder, which puts its packages first on the path. Logs under
# OUT/TREE-N (a tree's / as -). tests/host_pass.sh runs it for this checkout alone.
# Usage, from the project root: bash tests/host_ab.sh OUT base exp/NAME ...  (carry .device-wheels)
set -u
out=${1:?usage: tests/host_ab.sh OUT TREE...}; shift
mkdir -p "$out"
root=$PWD start=$SECONDS
[ -d .device-wheels ] && source "$(dirname "$0")/gpu_install.sh"
for i in $(seq "${ROUNDS:-6}"); do
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
for tree in "$@"; do
  cat "$out/${tree//\//-}"-*.txt 2>/dev/null | grep "^decode at" \
    | sed -n 's/.*median \([0-9.]*\) %.*/\1/p' | sort -n | awk -v tree="$tree" '{ v[NR] = $1 }
      END { if (NR) printf "%s: median of %d rounds %.1f %% (target >= 85 %%)\n", tree, NR,
            NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'
done
