#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-quantize, the benchmark peer, from the llama.cpp
# vendored in the pinned llama-cpp-python sdist (PyPI is the only registry this project reaches).
#
# Two builds, each in its own folder under the cache dir:
#   native   (default) GGML_NATIVE=ON: -march=native, what a user compiling llama.cpp on this
#            machine gets, and what our own kernels are built with. Kept in build-native-<key>,
#            <key> a digest of the CPU's feature flags, so a cache copied to (or shared with) a
#            machine with other features is never run there: a native build can die with SIGILL
#            on a CPU that lacks an instruction it was built for.
#   portable GGML_NATIVE=OFF with AVX2/FMA/F16C only (runs on any x86-64 with AVX2), in
#            build-portable.
#
# Idempotent: if both binaries exist in the build's folder, it prints the bin dir and exits.
# Usage: benchmarks/peers/build_llama_server.sh                 (prints the bin dir on its last line)
#        benchmarks/peers/build_llama_server.sh --print-bin-dir (the bin dir, built or not; no build)
# Env:   LLAMA_CPP_BUILD (native | portable; default native), LLAMA_CPP_PYTHON_VERSION (default
#        below), PREFIXSERVE_LLAMA_CPP_DIR (cache dir, default
#        ~/.cache/prefixserve/llama.cpp/<version>), JOBS (default 2), PYTHON (for pip).
# Not part of CI or `make test`: it takes 10-20 minutes on two cores.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${PREFIXSERVE_LLAMA_CPP_DIR:-$HOME/.cache/prefixserve/llama.cpp/$VERSION}"
BUILD="${LLAMA_CPP_BUILD:-native}"
JOBS="${JOBS:-2}"
PYTHON="${PYTHON:-python3}"

# The CPU's feature flags, one digest: /proc/cpuinfo's first "flags" line (Linux), else the
# machine name (a native build elsewhere is then keyed by architecture only).
cpu_key() {
    local flags
    flags="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2- || true)"
    [[ -n "$flags" ]] || flags="$(uname -m)"
    printf '%s' "$(tr -s ' ' '\n' <<<"$flags" | sed '/^$/d' | sort | tr '\n' ' ')" \
        | sha256sum | cut -c1-12
}

case "$BUILD" in
    native)
        BUILD_DIR="$CACHE/build-native-$(cpu_key)"
        ARCH_FLAGS=(-DGGML_NATIVE=ON)
        ;;
    portable)
        BUILD_DIR="$CACHE/build-portable"
        ARCH_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                    -DGGML_AVX512=OFF)
        ;;
    *)
        echo "LLAMA_CPP_BUILD must be native or portable, not '$BUILD'" >&2
        exit 2
        ;;
esac
BIN="$BUILD_DIR/bin"

if [[ "${1:-}" == "--print-bin-dir" ]]; then
    echo "$BIN"
    exit 0
fi

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

cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD_DIR" -G "Unix Makefiles" \
    -DCMAKE_BUILD_TYPE=Release "${ARCH_FLAGS[@]}" -DGGML_CUDA=OFF -DGGML_METAL=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF >&2
nice -n 10 cmake --build "$BUILD_DIR" --config Release -j "$JOBS" \
    --target llama-server llama-quantize >&2

"$BIN/llama-server" --version >&2 || true
echo "$BIN"
