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
# FlashInfer's headers (scripts/fetch_flashinfer.sh; CUDA builds only): the BF16 prefill attention
# runs on FlashInfer's kernels and its decode is there for comparison (docs/gpu-engine.md). Fetched
# when nvcc is present, unless OSCAR_FLASHINFER=0; without them the build uses our kernels only.
if command -v nvcc >/dev/null && [[ ${OSCAR_FLASHINFER:-1} != 0 ]]; then
  bash scripts/fetch_flashinfer.sh || echo "build.sh: FlashInfer's headers not fetched; building without them"
fi
FI=(-DOSCAR_FLASHINFER_INCLUDE=)
if [[ ${OSCAR_FLASHINFER:-1} != 0 && -f .deps/flashinfer/include/flashinfer/attention/decode.cuh ]]; then
  FI=(-DOSCAR_FLASHINFER_INCLUDE="$PWD/.deps/flashinfer/include")
fi
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "${FI[@]}" "$@"
cmake --build "$BUILD_DIR" -j"${JOBS:-$(nproc)}"
