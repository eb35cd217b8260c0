#!/usr/bin/env bash
# Build llama.cpp's own C++ `llama-server` (continuous batching, parallel slots) from the llama.cpp
# sources vendored in the llama-cpp-python sdist on PyPI: the honest single-machine peer for the
# benchmarks (issue 15). Outside the project's venv; never run by CI.
#
#   benchmarks/build_llama_server.sh [DEST]      # DEST defaults to /tmp/llama-server-build
#   JOBS=2 nice -n 19 benchmarks/build_llama_server.sh   # on a shared machine
#   -> DEST/bin/llama-server, DEST/bin/llama-quantize  (10-30 minutes on 2 cores)
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 picks the sdist (and so the llama.cpp commit) to build.
#
# Then:  python -m benchmarks --workloads S1,W1 --systems forklm-http,llama-server-np16
#        [--llama-server DEST/bin/llama-server]    (benchmarks/servers.py llama_server)
# or by hand:  DEST/bin/llama-server -m MODEL.gguf -t 2 -np 16 -c 32768 --port 8089
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
DEST="$(realpath -m "${1:-/tmp/llama-server-build}")"
JOBS="${JOBS:-$(nproc)}"
mkdir -p "$DEST/src"
cd "$DEST/src"

if [ ! -d "llama_cpp_python-$VERSION" ]; then
  python3 -m pip download --no-binary :all: --no-deps \
    "llama-cpp-python==$VERSION" -d . >/dev/null
  tar xzf "llama_cpp_python-$VERSION.tar.gz"
fi
LLAMA="$DEST/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
[ -f "$LLAMA/CMakeLists.txt" ] || { echo "no llama.cpp sources under $LLAMA" >&2; exit 1; }

# This CPU's instruction sets (AVX-512 / AVX2 as it has) named one by one rather than
# -march=native, and never AMX: these VMs list amx_tile in /proc/cpuinfo, and llama.cpp's AMX
# matmul dies with SIGILL (tilezero) on the first matmul, also where the tiles are enabled and
# granted (session 26's Intel Xeon ran forklm's AMX kernel; llama.cpp's died there too, with the
# permission asked for beforehand: one of its kernels runs tiles unconfigured).
isa_flags() {
  local have opts="" pair
  have=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  for pair in sse4_2:SSE42 f16c:F16C fma:FMA bmi2:BMI2 avx:AVX avx2:AVX2 avx_vnni:AVX_VNNI \
              avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    case "$have" in *" ${pair%%:*} "*) opts+=" -DGGML_${pair#*:}=ON" ;; *) opts+=" -DGGML_${pair#*:}=OFF" ;; esac
  done
  echo "$opts -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
}

# OpenMP, no libcurl (no Hub downloads).
# shellcheck disable=SC2046  # isa_flags is a list of -D options
cmake -S "$LLAMA" -B "$DEST/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF $(isa_flags) -DGGML_OPENMP=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >/dev/null
# llama-quantize makes the Q4_K_M / Q5_K_M mixes of the synthetic GGUFs (benchmarks/gguf_sizes.py).
cmake --build "$DEST/build" --target llama-server llama-quantize -j "$JOBS"
mkdir -p "$DEST/bin"
cp "$DEST/build/bin/llama-server" "$DEST/build/bin/llama-quantize" "$DEST/bin/"
echo "$DEST/bin/llama-server"
"$DEST/bin/llama-server" --version 2>&1 | head -2 || true
