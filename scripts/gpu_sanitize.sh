#!/usr/bin/env bash
# On the GPU machine, after unpacking scripts/gpu_engine_pack.sh's files into /tmp/p:
#   bash scripts/gpu_sanitize.sh TOOL [TEST ...]
# runs NVIDIA compute-sanitizer's TOOL (memcheck with leak checking, racecheck,
# synccheck or initcheck) over the CUDA test binaries (default: test_cuda and
# test_cuda_backend), one log per binary in $OUT (or /tmp/cs), and prints one line
# per binary: the tool's summary and the test result. Exit 1 when any run found
# an error or failed a test. GTEST_FILTER narrows the tests; CS_ARGS adds
# compute-sanitizer options (racecheck over cuBLAS's GEMMs takes > 5 minutes:
# CS_ARGS='--kernel-name-exclude regex=gemm|xmma|cutlass' checks our kernels only).
set -u
TOOL=${1:?usage: gpu_sanitize.sh memcheck|racecheck|synccheck|initcheck [test ...]}
shift
TESTS=("$@")
((${#TESTS[@]})) || TESTS=(test_cuda test_cuda_backend)
CS=${CS:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
LOGS=${OUT:-/tmp/cs}
mkdir -p "$LOGS"
read -r -a extra <<<"${CS_ARGS:-}"
[[ $TOOL == memcheck ]] && extra+=(--leak-check full)
status=0
for t in "${TESTS[@]}"; do
  log="$LOGS/$TOOL-$t.log"
  t0=$(date +%s)
  timeout "${CS_TIMEOUT:-280}" "$CS" --tool "$TOOL" "${extra[@]}" --error-exitcode 3 --print-limit 50 \
    "/tmp/p/bin/$t" --gtest_brief=1 >"$log" 2>&1
  rc=$?
  summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY" "$log" | tr '\n' ' ')
  tests=$(grep -E "^\[  PASSED  \]|^\[  FAILED  \]|tests ran" "$log" | tr '\n' ' ')
  echo "$TOOL $t: rc=$rc $(( $(date +%s) - t0 )) s | $summary| $tests"
  [[ $rc -eq 0 ]] || status=1
done
exit $status
