#!/usr/bin/env bash
# Packs the CUDA engine's binaries (built here with nvcc: test_cuda, test_cuda_backend,
# bench_gpu_engine, oscar) and the Debian libraries they need into two files
# for a GPU machine that has the CUDA toolkit but not our Debian packages:
#   .devlib.tar.xz  shared libraries (OpenBLAS, fmt, PCRE2, cpp-httplib, ...)
#   .devbin.tar.xz  the stripped binaries (~80 MB as they are: compressed, they fit the
#                   64 MiB a device call carries)
# On the GPU machine (docs/gpu-engine.md):
#   mkdir -p /tmp/p && tar -C /tmp/p -xJf .devlib.tar.xz && tar -C /tmp/p -xJf .devbin.tar.xz
#   export LD_LIBRARY_PATH=/tmp/p/lib:/usr/local/cuda/lib64
#   /tmp/p/bin/test_cuda_backend && /tmp/p/bin/bench_gpu_engine --json out.json
# On a machine with a GPU and the Debian packages, just run the binaries from build/.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
cmake --build "$BUILD_DIR" --target test_cuda test_cuda_backend bench_gpu_engine bench_gemv oscar
rm -rf .devpay && mkdir -p .devpay/bin .devpay/lib
cp "$BUILD_DIR/tests/test_cuda" "$BUILD_DIR/tests/test_cuda_backend" "$BUILD_DIR/bench/bench_gpu_engine" "$BUILD_DIR/bench/bench_gemv" "$BUILD_DIR/oscar" .devpay/bin/
strip .devpay/bin/*
for l in libfmt.so.9 libpcre2-8.so.0 libopenblas.so.0 libgfortran.so.5 libquadmath.so.0 \
         libcpp-httplib.so.0.11 libbrotlidec.so.1 libbrotlienc.so.1 libbrotlicommon.so.1 \
         libssl.so.3 libcrypto.so.3 libz.so.1; do
  cp -L "/lib/x86_64-linux-gnu/$l" .devpay/lib/
done
[[ -f .devlib.tar.xz ]] || tar -C .devpay -cJf .devlib.tar.xz lib
tar -C .devpay -cJf .devbin.tar.xz bin
ls -la .devlib.tar.xz .devbin.tar.xz
# WHEELS=1: the openai client and its dependencies for gpu_engine_run.sh http (the GPU machine has
# no network), for the Python versions a GPU image may have.
if [[ -n ${WHEELS:-} ]]; then
  bash scripts/setup.sh
  OPENAI_VERSION=$(sed -n 's/^OPENAI_VERSION=//p' scripts/setup.sh)
  for v in 3.10 3.11 3.12 3.13; do
    .venv/bin/pip download -q "openai==$OPENAI_VERSION" -d .devwheels --python-version "$v" --only-binary=:all: \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
  done
  du -sh .devwheels
fi
