#!/usr/bin/env bash
# llama.cpp's source for the many-core side by side (issue 29 item 4; tests/manycore_pass.sh builds
# it on the GPU machine's host, which has no network): the llama-cpp-python 0.3.36 sdist from the
# package index vendors it. Kept: what `cmake -B build ... --target llama-bench` reads (CMake
# files, ggml with its CPU backend only, src, include, common, vendor, tools, app: the top-level
# CMakeLists.txt adds app/ unconditionally); left out: docs, models (test vocabularies), tests,
# examples, media, the web UI and server, the Python converters, the GPU backends.
# Usage, from the project root (here, with the index): bash tests/llama_cpp_source.sh
# Writes build/llama.cpp.tar.xz (~3.5 MB; carry it to the device: carry=["build/llama.cpp.tar.xz"]).
set -euo pipefail
version=0.3.36
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$tmp"
tar xzf "$tmp/llama_cpp_python-$version.tar.gz" -C "$tmp"
src="$tmp/llama_cpp_python-$version/vendor/llama.cpp"
( cd "$src" \
  && rm -rf docs models media tests examples pocs benches tools/ui tools/server conversion scripts \
            skills grammars .github gguf-py requirements convert_*.py flake.nix ci \
            build-xcframework.sh ggml/src/ggml-cpu/kleidiai ggml/src/ggml-cpu/spacemit \
  && for d in ggml/src/ggml-*/; do [ "$d" = ggml/src/ggml-cpu/ ] || rm -rf "$d"; done )
mkdir -p build
tar cJf build/llama.cpp.tar.xz -C "$(dirname "$src")" llama.cpp
echo "build/llama.cpp.tar.xz: $(du -h build/llama.cpp.tar.xz | cut -f1) packed, $(du -sh "$src" | cut -f1) unpacked (llama-cpp-python $version's vendor/llama.cpp)"
