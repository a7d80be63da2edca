#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-quantize, the benchmark peer, from the llama.cpp
# vendored in the pinned llama-cpp-python sdist (PyPI is the only registry this project reaches).
#
# Portable x86-64 target: GGML_NATIVE=OFF with AVX2/FMA/F16C only. A native build on a
# machine with AVX-512 has died with SIGILL in quantized paths when run elsewhere.
#
# Idempotent: if both binaries exist under the cache dir, it prints the bin dir and exits.
# Usage: benchmarks/peers/build_llama_server.sh            (prints the bin dir on its last line)
# Env:   LLAMA_CPP_PYTHON_VERSION (default below), PREFIXSERVE_LLAMA_CPP_DIR (cache dir,
#        default ~/.cache/prefixserve/llama.cpp/<version>), JOBS (default 2), PYTHON (for pip).
# Not part of CI or `make test`: it takes 10-20 minutes on two cores.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${PREFIXSERVE_LLAMA_CPP_DIR:-$HOME/.cache/prefixserve/llama.cpp/$VERSION}"
JOBS="${JOBS:-2}"
PYTHON="${PYTHON:-python3}"
BIN="$CACHE/build/bin"

if [[ -x "$BIN/llama-server" && -x "$BIN/llama-quantize" ]]; then
    echo "already built: $BIN" >&2
    echo "$BIN"
    exit 0
fi

mkdir -p "$CACHE"
SDIST="$CACHE/llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
    "$PYTHON" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$CACHE" >&2
fi
SRC="$CACHE/llama_cpp_python-$VERSION"
if [[ ! -d "$SRC/vendor/llama.cpp" ]]; then
    tar -xzf "$SDIST" -C "$CACHE"
fi

cmake -S "$SRC/vendor/llama.cpp" -B "$CACHE/build" -G "Unix Makefiles" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_AVX512=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF >&2
nice -n 10 cmake --build "$CACHE/build" --config Release -j "$JOBS" \
    --target llama-server llama-quantize >&2

"$BIN/llama-server" --version >&2 || true
echo "$BIN"
