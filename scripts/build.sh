#!/usr/bin/env bash
# Configures and builds into ./build (CUDA sources too when nvcc is on PATH or
# in /usr/local/cuda). Extra arguments go to cmake's configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
BUILD_DIR=${BUILD_DIR:-build}
# FlashInfer's headers, where scripts/fetch_flashinfer.sh put them: the engine's BF16 decode
# baseline on FlashInfer's kernel is built too (CUDA builds only).
FI=()
if [[ -f .deps/flashinfer/include/flashinfer/attention/decode.cuh ]]; then
  FI=(-DOSCAR_FLASHINFER_INCLUDE="$PWD/.deps/flashinfer/include")
fi
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "${FI[@]}" "$@"
cmake --build "$BUILD_DIR" -j"${JOBS:-$(nproc)}"
