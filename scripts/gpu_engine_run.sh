#!/usr/bin/env bash
# On the GPU machine (the H200 here): unpacks what scripts/gpu_engine_pack.sh made (carry
# .devlib.tar.xz and .devbin.tar.xz),
# runs the CUDA kernels' and engine's tests against the CPU references and the end-to-end
# benchmark, and leaves the logs and the JSON in $OUT (docs/gpu-engine.md).
#
#   bash scripts/gpu_engine_run.sh [tests|bench|all|profile|rotation|penalty|http|heads|mixed]     (default all)
# profile: one decode step per configuration under Nsight Compute (per-kernel GPU
# times, $OUT/profile.csv; summarize with python3 scripts/profile_step.py).
# rotation: the tensor-core (3xTF32) query/key rotation's test, then the prefill A/B with it
#   off and on (OSCAR_CUDA_ROTATE_MMA=0 / auto, the default; docs/gpu-engine.md, Rerun).
# penalty: the sampled step with a repetition penalty over 8192 distinct ids per row, penalty slots
#   on and off (OSCAR_CUDA_PENALTY_SLOTS), after the sampling tests (docs/gpu-engine.md, Sampling).
# http: the HTTP server's end-to-end tests (tests/serve/test_http.py) against `oscar serve --device cuda`
#   (each server 32768 tokens of KV, as on the CPU: several run at once on the one GPU), with OSCAR_MODEL (the default model's GGUF) and the openai client's wheels in .devwheels/
#   (WHEELS=1 bash scripts/gpu_engine_pack.sh fetches them here). HTTP_TESTS: test classes to run (default all);
#   HTTP_TIMEOUT: seconds for the suite (default 580).
# heads: the one-launch attention inputs (qkv_heads_into_cache) against the three launches: the
#   CUDA backend's tests, then decode steps with OSCAR_CUDA_FUSE_HEADS=1 and 0, two rounds, Qwen3-8B
#   and Qwen2.5-1.5B shapes, BF16 vs 2-bit (docs/gpu-engine.md, Rerun).
# mixed: serving-like steps (decode rows beside a prefill chunk) on Qwen2.5-1.5B shapes, with the
#   calibration $CALIB if given (else a data-free Hadamard one), BF16 vs 2-bit.
# Environment: OSCAR_MODEL (the default model's GGUF, for the real-model test),
# BENCH_ARGS (extra bench_gpu_engine flags; default: the Qwen3-8B matrix of the doc),
# GTEST_FILTER (a subset of test_cuda_backend).
set -uo pipefail
MODE=${1:-all}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT" /tmp/p
tar -C /tmp/p -xJf .devlib.tar.xz && tar -C /tmp/p -xJf .devbin.tar.xz || exit 1
export LD_LIBRARY_PATH=/tmp/p/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv,noheader
rc=0
# filtered_tests BINARY FILTER LOG LABEL: one test binary on a gtest filter, its verdicts and
# failures printed, its exit status kept in rc.
filtered_tests() {
  timeout 300 "/tmp/p/bin/$1" --gtest_filter="$2" > "$OUT/$3" 2>&1
  local r=$?
  ((r)) && rc=$r
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|Expected|Which is" "$OUT/$3" | head -20
  echo "$4: exit $r"
}
if [[ $MODE == rotation ]]; then
  filtered_tests test_cuda 'CudaDecode.Rotate*' test_rotate.log "rotation tests"
  for M in 0 auto; do
    t0=$(date +%s)
    OSCAR_CUDA_ROTATE_MMA=$M /tmp/p/bin/bench_gpu_engine --preset qwen3-8b --kv-gib 100 --ctx none --batch 128 \
      --batch-ctx 32768 --long-ctx 0 --steps 5 --graphs on --prefill 8192,32768 --methods bf16,int2 \
      --json "$OUT/rotation-mma$M.json" 2> "$OUT/rotation-mma$M.err" | grep -E "^batch|^prefill" | sed "s/^/mma=$M /"
    r=${PIPESTATUS[0]}; ((r)) && { rc=$r; tail -5 "$OUT/rotation-mma$M.err"; }
    echo "rotation A/B, OSCAR_CUDA_ROTATE_MMA=$M: exit $r after $(( $(date +%s) - t0 )) s"
  done
  exit $rc
fi
if [[ $MODE == penalty ]]; then
  filtered_tests test_cuda_backend 'CudaSample.*' test_sample.log "sampling tests"
  for S in 1 0; do
    for H in 1024 8192; do
      t0=$(date +%s)
      OSCAR_CUDA_PENALTY_SLOTS=$S /tmp/p/bin/bench_gpu_engine --preset qwen3-8b --kv-gib 20 --ctx none --batch none \
        --long-ctx 0 --prefill 0 --methods bf16 --graphs on --steps 10 --sample-batch 1,32,128 --sample-ctx 2048 \
        --sample-temp 0.25 --sample-top-p 0.95 --sample-penalty 1.1 --sample-history $H \
        --json "$OUT/penalty-slots$S-h$H.json" 2> "$OUT/penalty-slots$S-h$H.err" | grep "^sampled" | sed "s/^/slots=$S /"
      r=${PIPESTATUS[0]}; ((r)) && { rc=$r; tail -5 "$OUT/penalty-slots$S-h$H.err"; }
      echo "penalty A/B, OSCAR_CUDA_PENALTY_SLOTS=$S, $H ids: exit $r after $(( $(date +%s) - t0 )) s"
    done
  done
  exit $rc
fi
if [[ $MODE == http ]]; then
  [[ -n ${OSCAR_MODEL:-} && -f ${OSCAR_MODEL:-} ]] || { echo "http: set OSCAR_MODEL to the default model's GGUF"; exit 2; }
  python3 -m pip install -q --no-index --find-links .devwheels --target /tmp/pyo openai > "$OUT/http-pip.log" 2>&1 \
    || { tail -5 "$OUT/http-pip.log"; exit 1; }
  t0=$(date +%s)
  # shellcheck disable=SC2086  # HTTP_TESTS: class names, split on purpose
  PYTHONPATH=/tmp/pyo timeout ${HTTP_TIMEOUT:-580} python3 tests/serve/test_http.py --oscar /tmp/p/bin/oscar --model "$OSCAR_MODEL" \
    --server-args "--device cuda --max-kv-tokens 32768" --log-dir "$OUT/http-logs" ${HTTP_TESTS:-} > "$OUT/http.log" 2>&1
  rc=$?
  grep -E "^(FAIL|ERROR)|^Ran |^OK|^FAILED" "$OUT/http.log" | head -30
  echo "HTTP tests on the GPU server: exit $rc after $(( $(date +%s) - t0 )) s"
  exit $rc
fi
if [[ $MODE == heads ]]; then
  t0=$(date +%s)
  timeout 240 /tmp/p/bin/test_cuda_backend --gtest_filter="${GTEST_FILTER:-*}" > "$OUT/test_cuda_backend.log" 2>&1
  r=$?; ((r)) && rc=$r
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|Expected|Which is|one launch|vs CPU" "$OUT/test_cuda_backend.log" | head -30
  echo "test_cuda_backend: exit $r after $(( $(date +%s) - t0 )) s"
  T0=$(date +%s)
  for round in 1 2; do
    for P in qwen3-8b qwen25-1.5b; do
      for F in 1 0; do
        # the second round only while the call has time left (a call runs at most 600 s)
        (( round == 2 && $(date +%s) - T0 > ${HEADS_BUDGET:-330} )) && continue
        t0=$(date +%s)
        OSCAR_CUDA_FUSE_HEADS=$F /tmp/p/bin/bench_gpu_engine --preset $P --kv-gib 40 --ctx none --batch 1,8 \
          --batch-ctx 32768 --long-ctx 100000 --steps 10 --graphs on --prefill 0 --methods bf16,int2 \
          --json "$OUT/heads-$P-fuse$F-r$round.json" 2> "$OUT/heads-$P-fuse$F-r$round.err" | grep "^batch" \
          | sed "s/^/$P fuse=$F r$round /"
        r=${PIPESTATUS[0]}; ((r)) && { rc=$r; tail -5 "$OUT/heads-$P-fuse$F-r$round.err"; }
        echo "$P, OSCAR_CUDA_FUSE_HEADS=$F, round $round: exit $r after $(( $(date +%s) - t0 )) s"
      done
    done
  done
  exit $rc
fi
if [[ $MODE == mixed ]]; then
  CARGS=()
  METHODS=bf16,int2
  if [[ -n ${CALIB:-} ]]; then CARGS=(--calib "$CALIB"); METHODS=bf16,int2,int2-nocenter; fi
  for T in 128 0; do
    t0=$(date +%s)
    OSCAR_CUDA_ROTATE_TILED=$T /tmp/p/bin/bench_gpu_engine --preset qwen25-1.5b ${CARGS[@]+"${CARGS[@]}"} --kv-gib 20 --ctx none \
      --batch none --long-ctx 0 --prefill 0 --steps 5 --methods $METHODS --mixed 128:8192:8064,16:8192:8064 \
      --json "$OUT/mixed-tiled$T.json" 2> "$OUT/mixed-tiled$T.err" | grep "^mixed" | sed "s/^/tiled=$T /"
    r=${PIPESTATUS[0]}; ((r)) && { rc=$r; tail -5 "$OUT/mixed-tiled$T.err"; }
    echo "mixed steps, OSCAR_CUDA_ROTATE_TILED=$T: exit $r after $(( $(date +%s) - t0 )) s"
  done
  exit $rc
fi
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
