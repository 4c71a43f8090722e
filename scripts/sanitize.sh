#!/usr/bin/env bash
# Sanitizer builds of the CPU code (clang, no CUDA, no benchmarks):
#   bash scripts/sanitize.sh [asan|tsan] [ctest args...]
# asan (default): AddressSanitizer + UndefinedBehaviorSanitizer (+ LeakSanitizer) over
#   every CPU test, in build-asan/. The same build carries the libFuzzer
#   instrumentation, so scripts/fuzz.sh reuses it.
# tsan: ThreadSanitizer over the CPU tests of the threaded code (thread pools in the
#   kernels and GEMMs, batched generation, scheduler, async engine, chat templates)
#   and the server's concurrency tests, in build-tsan/.
# Any sanitizer report fails the test that triggered it (-fno-sanitize-recover=all).
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-asan}
[[ $# -gt 0 ]] && shift
bash scripts/setup.sh
PKGS=(clang libclang-rt-14-dev llvm)
missing=()
for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO=sudo
  echo "sanitize: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# -O1: the sanitizers' recommended level, and the SIMD files compile several times
# faster than at -O2. -gline-tables-only: file:line in every report.
common=(-G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=Release
        "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -gline-tables-only" "-DCMAKE_C_FLAGS_RELEASE=-O1 -gline-tables-only"
        -DOSCAR_CUDA=OFF -DOSCAR_BUILD_BENCH=OFF -DOSCAR_WERROR=OFF)
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}

# tests/serve/test_http.py's named tests against the sanitized server ($1 = build dir).
http_tests() {
  local build=$1 model=models/SmolLM2-135M-Instruct.Q4_1.gguf
  shift
  if [[ -f $model && -x .venv/bin/python ]]; then
    .venv/bin/python tests/serve/test_http.py --oscar "$build/oscar" --model "$model" "$@"
  else
    echo "sanitize: $model or .venv absent: the server's HTTP tests are skipped"
  fi
}
case "$MODE" in
  asan)
    BUILD=${BUILD_DIR:-build-asan}
    cmake -S . -B "$BUILD" "${common[@]}" -DOSCAR_SANITIZE=address,undefined -DOSCAR_FUZZ=ON
    cmake --build "$BUILD" -j"${JOBS:-$(nproc)}"
    [[ -n "${NO_TEST:-}" ]] && exit 0  # scripts/fuzz.sh: the build only
    # serve_http is timed (a load test, 10 s idle checks, a 540 s watchdog) and the
    # ASan+UBSan server decodes ~10x slower, so it runs here as its hostile-input and
    # protocol tests only (below), not as the whole CTest entry.
    ctest --test-dir "$BUILD" --output-on-failure -j"$(nproc)" -E '^serve_http$' "$@"
    http_tests "$BUILD" TestHostileInput TestCurl TestOpenAIClient.test_completion_token_prompt
    ;;
  tsan)
    BUILD=${BUILD_DIR:-build-tsan}
    cmake -S . -B "$BUILD" "${common[@]}" -DOSCAR_SANITIZE=thread
    cmake --build "$BUILD" -j"${JOBS:-$(nproc)}" --target test_core test_kernels test_kv test_model test_engine test_eval test_serve oscar
    # OpenBLAS's own threads are not instrumented: one BLAS thread keeps TSan on our code.
    # Every test of those binaries (our thread pools run inside the kernels, GEMMs and
    # forwards), then the server's concurrency, protocol and hostile-input HTTP tests.
    export OPENBLAS_NUM_THREADS=1
    ctest --test-dir "$BUILD" --output-on-failure -j"$(nproc)" \
      -E '^(serve_http|hostile_files|include_layers|fuzz_.*)$' "$@"
    http_tests "$BUILD" TestConcurrency TestHostileInput TestCurl
    ;;
  *) echo "usage: $0 [asan|tsan] [ctest args...]" >&2; exit 2 ;;
esac
