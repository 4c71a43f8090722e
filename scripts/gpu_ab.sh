#!/usr/bin/env bash
# Same-call A/B of the decode kernel on the GPU machine: the working tree (B)
# against another checkout (A, default .ab: `git worktree add .ab <commit>`,
# carried with the tree), both head_dim-128-only builds of bench_decode, the
# shapes in SHAPES timed alternately REPS times, L2 emptied by a read. TRACE=1
# adds a -DOSCAR_DECODE_TRACE build of B and its CTA timeline (--trace) on
# TRACE_SHAPES. C_FLAGS="-D..." (and D_FLAGS) add a third (fourth) build, c
# (d), of the working tree with those CUDA flags, timed in the same rounds.
# A=none: no other checkout (only the working tree's builds). SWEEP="args1|args2|..."
# times builds b, c, d once per set of bench_decode arguments (b0, b1, ...: e.g.
# SWEEP="--fuse 0|--fuse 1"), interleaved in the same rounds. T_ARGS: extra
# bench_decode arguments of the trace runs. Each line: the call's median, the
# step write alone, the write's and the demotion's cost inside a step, and
# the read floor.
# ITERS (default 100): timed calls per shape and build. A fresh process's
# first few dozen calls run slower (8 x 32K: 54 us median of 15, 49.5 of 200;
# docs/history.md, v34), so short runs understate the steady state.
# Logs in $OUT.
#   bash scripts/gpu_ab.sh            (carry .deps and .ab)
set -uo pipefail
OUT=${OUT:-$PWD/out}
A=${A:-.ab}
SHAPES=${SHAPES-"1,131072 8,32768 8,65536 32,32768 64,65536"}
REPS=${REPS:-2}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH
[[ $A == none || -e $A/.deps ]] || ln -sfn "$PWD/.deps" "$A/.deps"
build() {  # src dir, build dir, extra CUDA flags
  cmake -S "$1/tests/cuda/gpu_build" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_FLAGS="-DOSCAR_CUDA_MIN_INSTANCES $3" > "$OUT/$(basename "$2").log" 2>&1 \
    && ninja -C "$2" -j6 bench_decode >> "$OUT/$(basename "$2").log" 2>&1
}
t0=$(date +%s)
# a: the other checkout; b: the working tree; c, d: the working tree with
# C_FLAGS / D_FLAGS; t: the working tree's trace build.
VARIANTS="a b"
[[ $A == none ]] && VARIANTS="b"
[[ -n ${C_FLAGS:-} ]] && VARIANTS+=" c"
[[ -n ${D_FLAGS:-} ]] && VARIANTS+=" d"
BUILDS=$VARIANTS
[[ ${TRACE:-0} == 1 ]] && BUILDS+=" t"
declare -A SRC=([a]=$A [b]=. [c]=. [d]=. [t]=.)
declare -A FLAGS=([a]="" [b]="" [c]="${C_FLAGS:-}" [d]="${D_FLAGS:-}" [t]="-DOSCAR_DECODE_TRACE ${T_FLAGS:-}")
declare -A PID
for v in $BUILDS; do
  build "${SRC[$v]}" build-ab-$v "${FLAGS[$v]}" & PID[$v]=$!
done
for v in $BUILDS; do
  wait "${PID[$v]}" || { echo "build $v failed"; tail -20 "$OUT/build-ab-$v.log"; exit 1; }
done
echo "builds: $(( $(date +%s) - t0 ))s"
grep -hE "registers|spill" "$OUT"/build-ab-*.log | sort | uniq -c | sort -rn | head -6
export OSCAR_BENCH_FLUSH=read
for rep in $(seq "$REPS"); do
  for ob in $SHAPES; do
    for v in $VARIANTS; do
      IFS='|' read -ra ARGSETS <<< "${SWEEP:-}"
      [[ $v != a && $v != t && ${#ARGSETS[@]} -gt 0 ]] || ARGSETS=("")
      for k in "${!ARGSETS[@]}"; do
        label=$v; ((${#ARGSETS[@]} > 1)) && label=$v$k
        printf "%-3s rep%s %-9s %-14s " "$label" "$rep" "$ob" "${ARGSETS[$k]}"
        # shellcheck disable=SC2086  # the sweep's arguments split into words
        ./build-ab-$v/bench_decode --only "$ob" --int2 --iters "${ITERS:-100}" ${ARGSETS[$k]} 2>&1 | grep -E "^int2 " |
          awk '{print $4" us  (step write "$10" us, in the step "$12", demotion in the step "$13"; read floor "$NF")"}'
      done
    done
  done
done | tee "$OUT/ab.log"
if [[ ${TRACE:-0} == 1 ]]; then
  for ob in ${TRACE_SHAPES:-8,32768 32,32768}; do
    ./build-ab-t/bench_decode --only "$ob" --trace-dump "$OUT/trace.csv" ${T_ARGS:-} 2>&1 | grep -E "^trace"
  done | tee "$OUT/trace.log"
fi
