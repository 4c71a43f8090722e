#!/usr/bin/env bash
# On the GPU machine (the H200 here): unpacks what scripts/gpu_engine_pack.sh made,
# runs the CUDA kernels' and engine's tests against the CPU references and the end-to-end
# benchmark, and leaves the logs and the JSON in $OUT (docs/gpu-engine.md).
#
#   bash scripts/gpu_engine_run.sh [tests|bench|all|profile]     (default all)
# profile: one decode step per configuration under Nsight Compute (per-kernel GPU
# times, $OUT/profile.csv; summarize with python3 scripts/profile_step.py).
# Environment: OSCAR_MODEL (the default model's GGUF, for the real-model test),
# BENCH_ARGS (extra bench_gpu_engine flags; default: the Qwen3-8B matrix of the doc),
# GTEST_FILTER (a subset of test_cuda_backend).
set -uo pipefail
MODE=${1:-all}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT" /tmp/p
tar -C /tmp/p -xJf .devlib.tar.xz && tar -C /tmp/p -xf .devbin.tar || exit 1
export LD_LIBRARY_PATH=/tmp/p/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv,noheader
rc=0
if [[ $MODE != bench && $MODE != profile ]]; then
  t0=$(date +%s)
  # The kernels against their CPU references (tests/cuda).
  timeout 300 /tmp/p/bin/test_cuda > "$OUT/test_cuda.log" 2>&1
  r=$?; ((r)) && rc=$r
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED" "$OUT/test_cuda.log" | head -20
  echo "test_cuda: exit $r after $(( $(date +%s) - t0 )) s"
  t0=$(date +%s)
  /tmp/p/bin/test_cuda_backend --gtest_filter="${GTEST_FILTER:-*}" > "$OUT/test_cuda_backend.log" 2>&1
  r=$?; ((r)) && rc=$r
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|oscar cache, CUDA|default model," "$OUT/test_cuda_backend.log" | head -40
  echo "test_cuda_backend: exit $r after $(( $(date +%s) - t0 )) s"
fi
if [[ $MODE == profile ]]; then
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  PARGS=${BENCH_ARGS:---preset qwen3-8b --ctx none --batch 1,8 --batch-ctx 32768 --long-ctx 0 --graphs on --prefill 0 --steps 3}
  t0=$(date +%s)
  # shellcheck disable=SC2086
  /tmp/p/bin/bench_gpu_engine $PARGS 2> "$OUT/bench-plain.err" | grep -E "^batch|split" | tee "$OUT/bench-plain.log"
  echo "plain run: $(( $(date +%s) - t0 )) s"
  t0=$(date +%s)
  # shellcheck disable=SC2086
  OSCAR_BENCH_PROFILE=1 "$NCU" --profile-from-start off --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --csv --log-file "$OUT/profile.csv" \
    /tmp/p/bin/bench_gpu_engine $PARGS > "$OUT/bench.log" 2> "$OUT/bench.err"
  r=$?; ((r)) && { rc=$r; tail -5 "$OUT/bench.err"; }
  echo "profile: exit $r after $(( $(date +%s) - t0 )) s, $(wc -l < "$OUT/profile.csv") csv lines"
  exit $rc
fi
if [[ $MODE != tests ]]; then
  t0=$(date +%s)
  # shellcheck disable=SC2086
  /tmp/p/bin/bench_gpu_engine ${BENCH_ARGS:---preset qwen3-8b --kv-gib 100 --ctx 32768 --batch 1,8,32,64 --batch-ctx 32768 --long-ctx 100000 --steps 5} \
    --json "$OUT/bench.json" 2> "$OUT/bench.err" | tee "$OUT/bench.log"
  r=${PIPESTATUS[0]}; ((r)) && { rc=$r; tail -5 "$OUT/bench.err"; }
  echo "bench_gpu_engine: exit $r after $(( $(date +%s) - t0 )) s"
fi
exit $rc
