#!/usr/bin/env bash
# One GPU-machine call: standalone build of the CUDA kernels (tests/cuda/gpu_build,
# no Debian deps needed), the GPU tests against the CPU references, the decode
# benchmark (INT2 vs our BF16 kernel) and FlashInfer's BF16 paged decode on the
# same shapes, then one table (bench/cuda/report.py) and, with matplotlib, a plot
# of it (bench/cuda/plot_shapes.py). Logs go to $OUT.
#
#   bash scripts/gpu_run.sh [quick|full|tests|bench|tune|shapes]
#   shapes: only the shapes in SHAPES ("B,CTX B,CTX ...", default the batch-8
#   and large ones), ours and FlashInfer, then the table.
#   OSCAR_BENCH_FLUSH=read (env) empties L2 by a read instead of a memset in
#   both benchmarks (docs/kernels-cuda.md, "Benchmark protocol").
#
# Needs in the working tree (ignored, carried by the device tool):
#   .deps/googletest (copy of /usr/src/googletest), .deps/include/fmt (copy of
#   /usr/include/fmt), and optionally .whl/ with flashinfer_python-0.5.3 and
#   apache_tvm_ffi wheels (see docs/kernels-cuda.md).
set -uo pipefail
MODE=${1:-full}
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,memory.total,power.limit \
  --format=csv 2>&1
nvcc --version | tail -1

FI_WARM=""
FI=${FI:-1}  # FI=0 skips FlashInfer (tuning runs)
if [[ $MODE != tests && $FI == 1 ]] && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
  export MAX_JOBS=8
  # FlashInfer JIT-compiles its kernels: do it on the CPUs while we build and test.
  (python3 bench/cuda/flashinfer_decode.py warm "$OUT/warm.log" > "$OUT/warm.out" 2>&1; cat "$OUT/warm.out" >> "$OUT/warm.log"; rm -f "$OUT/warm.out") &
  FI_WARM=$!
fi

# AB_FLAGS="-DKNOB=..." builds a second, head_dim-128-only bench with those
# CUDA flags next to the main build and times it on three shapes at the end.
if [[ -n ${AB_FLAGS:-} ]]; then
  (cmake -S tests/cuda/gpu_build -B build-gpu-ab -G Ninja -DCMAKE_BUILD_TYPE=Release \
     -DCMAKE_CUDA_FLAGS="$AB_FLAGS -DOSCAR_CUDA_MIN_INSTANCES" > "$OUT/build-ab.log" 2>&1 \
     && ninja -C build-gpu-ab -j4 bench_decode >> "$OUT/build-ab.log" 2>&1) &
  AB_PID=$!
fi
t0=$(date +%s)
cmake -S tests/cuda/gpu_build -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release > "$OUT/build.log" 2>&1 \
  && ninja -C build-gpu -j12 >> "$OUT/build.log" 2>&1
rc=$?
grep -E "registers|spill" "$OUT/build.log" | sort | uniq -c | sort -rn | head -5
if ((rc)); then grep -E "error|FAILED" "$OUT/build.log" | head -30; exit 1; fi
echo "build: $(( $(date +%s) - t0 ))s"
if [[ ${SASS:-0} == 1 ]] && command -v cuobjdump > /dev/null; then
  obj=$(find build-gpu -name 'decode_split_d128.cu.o' | head -1)
  cuobjdump -sass "$obj" > "$OUT/sass.txt" 2>&1 && echo "sass: $(wc -l < "$OUT/sass.txt") lines"
fi

status=0
if [[ $MODE != bench && $MODE != shapes ]]; then
  # (The full log first: a pipe into `head` would end the tests with SIGPIPE.)
  ./build-gpu/test_cuda > "$OUT/test.log" 2>&1
  status=$?
  grep -E "^\s+\[|FAILED|PASSED|Failure|error" "$OUT/test.log" | head -80
  echo "test_cuda exit status: $status"
fi
[[ $MODE == tests ]] && exit $status

[[ -n $FI_WARM ]] && { wait $FI_WARM; tail -8 "$OUT/warm.log"; }
if [[ $MODE == tune ]]; then
  # Kernel-tuning run (no FlashInfer): the quick table (int2 / bf16 / int2v7 in
  # the same run), larger shapes, the PDL A/B; NCU=1 adds per-kernel durations
  # at batch 1 and a full profile of the INT2 split kernel at 32 x 32K.
  if command -v cuobjdump > /dev/null; then
    obj=$(find build-gpu -name 'decode_split_d128.cu.o' | head -1)
    cuobjdump -sass "$obj" > "$OUT/sass.txt" 2>&1
    python3 bench/cuda/sass_hist.py decode_split_kernelILi128ELi128ELb1ELi2 < "$OUT/sass.txt" | head -40
    python3 bench/cuda/sass_hist.py decode_split_kernelILi128ELi128ELb1ELi3 < "$OUT/sass.txt" | head -40
  fi
  ./build-gpu/bench_decode --quick 2>&1 | tee "$OUT/bench.log"
  for ob in 1,131072 8,131072 64,65536; do ./build-gpu/bench_decode --only $ob 2>&1 | grep -E "^(int2|bf16)"; done | tee -a "$OUT/bench.log"
  echo "-- no PDL"; for ob in 1,4096 1,131072 32,32768; do ./build-gpu/bench_decode --only $ob --pdl 0 2>&1 | grep -E "^int2 "; done | tee -a "$OUT/bench.log"
  if [[ ${NCU:-0} == 1 ]] && command -v ncu > /dev/null; then
    timeout 120 ncu --clock-control none -k regex:"decode_split|merge" -c 3 --section SpeedOfLight \
      ./build-gpu/bench_decode --only 1,131072 --iters 1 > "$OUT/ncu-b1.txt" 2>&1
    grep -E "decode_split|merge_kernel|Duration" "$OUT/ncu-b1.txt" | head -12
    timeout 200 ncu --clock-control none -k regex:decode_split -c 1 --set full \
      ./build-gpu/bench_decode --only 32,32768 --iters 1 > "$OUT/ncu-full.txt" 2>&1
    grep -E "Duration|Throughput|Registers|Achieved Occupancy|Issue Slots|Eligible|Executed Ipc|Stall|Pipe|pipe|Warp Cycles" "$OUT/ncu-full.txt" | head -60
  fi
  exit $status
fi
echo "L2 flush before each timed launch: ${OSCAR_BENCH_FLUSH:-write}"
if [[ $MODE == shapes ]]; then
  SHAPES=${SHAPES:-"1,131072 8,32768 8,65536 8,131072 32,32768 64,65536"}
  : > "$OUT/bench.log"
  for ob in $SHAPES; do
    ./build-gpu/bench_decode --only "$ob" --csv "$OUT/ours-$ob.csv" 2>&1 | tee -a "$OUT/bench.log"
    [[ $FI == 1 ]] && OSCAR_BENCH_ONLY=$ob python3 bench/cuda/flashinfer_decode.py bench "$OUT/fi-$ob.csv" 2>&1
  done
  # One CSV each (headers once).
  for k in ours fi; do
    first=1
    for f in "$OUT"/$k-*.csv; do
      [[ -f $f ]] || continue
      if ((first)); then cat "$f"; first=0; else tail -n +2 "$f"; fi
    done > "$OUT/$k.csv"
    rm -f "$OUT"/$k-*.csv
  done
else
  Q=""; [[ $MODE == quick ]] && Q=--quick
  ./build-gpu/bench_decode $Q --csv "$OUT/ours.csv" 2>&1 | tee "$OUT/bench.log"
  [[ $FI == 1 ]] && python3 bench/cuda/flashinfer_decode.py bench "$OUT/fi.csv" $Q 2>&1
fi
COPY=$(grep -oP 'copy_gbs=\K[0-9.]+' "$OUT/bench.log" | tail -1)
python3 bench/cuda/report.py "$OUT/ours.csv" "$OUT/fi.csv" "${COPY:-4300}" > "$OUT/table.md"
# The same run as a plot (times and speedups per shape) where matplotlib exists.
if python3 -c 'import matplotlib' 2> /dev/null; then
  python3 bench/cuda/plot_shapes.py "$OUT/ours.csv" "$OUT/fi.csv" "$OUT/shapes.png" || true
fi
# Optional profile of one INT2 launch (Nsight Compute works on the Firecracker machines).
if [[ ${NCU:-0} == 1 ]] && command -v ncu > /dev/null; then
  timeout 240 ncu --clock-control none -k regex:decode_split_kernel -c 1 --section SpeedOfLight \
    --section WarpStateStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section SchedulerStats \
    --metrics smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_tex_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio,smsp__average_warps_issue_stalled_imc_miss_per_issue_active.ratio \
    ./build-gpu/bench_decode --only 32,32768 --iters 1 > "$OUT/ncu.txt" 2>&1
  grep -E "Duration|Throughput|Registers|Achieved Occupancy|Theoretical Occupancy|Issue Slots|Eligible|No Eligible|Stall|Warp Cycles|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|Executed Ipc|stalled" "$OUT/ncu.txt" | head -60
fi
if [[ -n ${AB_FLAGS:-} ]]; then
  wait $AB_PID
  echo "-- A/B build ($AB_FLAGS) vs main build, int2 rows"
  for ob in 1,131072 8,131072 32,32768 64,65536; do
    ./build-gpu-ab/bench_decode --only $ob 2>&1 | grep -E "^int2 " | sed 's/^/ab   /'
    ./build-gpu/bench_decode --only $ob 2>&1 | grep -E "^int2 " | sed 's/^/main /'
  done | tee "$OUT/ab.log"
fi
echo; cat "$OUT/table.md"
exit $status
