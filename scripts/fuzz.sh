#!/usr/bin/env bash
# Runs the libFuzzer targets (fuzz/, docs/reliability.md) on the ASan+UBSan build
# of scripts/sanitize.sh (build-asan/, configured with -DOSCAR_FUZZ=ON):
#   bash scripts/fuzz.sh [seconds-per-target] [target ...]
# Defaults: 60 s for every target, two at a time (FUZZ_PARALLEL). FUZZ_RUNS=N also
# stops a target after N executions (the long campaign: FUZZ_RUNS=1000000 and 900 s).
# Each target starts from its seed corpus (fuzz_make_seeds) plus the corpus kept from
# earlier runs in build-asan/fuzz-corpus/<target>; a finding is written to
# build-asan/fuzz-findings/<target>/ and fails the run. At the end a table:
# target, seconds, executions, exec/s, corpus size, findings.
set -euo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-60}
[[ $# -gt 0 ]] && shift
ALL=(gguf safetensors calibration activation_dump tokenizer_json tokenizer openai_request chat_template)
TARGETS=("$@")
((${#TARGETS[@]})) || TARGETS=("${ALL[@]}")
BUILD=${BUILD_DIR:-build-asan}
# FUZZ_NO_BUILD=1: binaries and seeds are already in $BUILD (another machine's copy).
if [[ -z "${FUZZ_NO_BUILD:-}" ]]; then
  NO_TEST=1 bash scripts/sanitize.sh asan
  "$BUILD/fuzz/fuzz_make_seeds" "$BUILD/fuzz-seeds" >/dev/null
fi
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:strict_string_checks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
mkdir -p "$BUILD/fuzz-logs"

run_one() {
  local t=$1 extra=()
  case $t in
    gguf|safetensors|calibration|activation_dump) extra=(-max_len=65536) ;;
    tokenizer_json) extra=(-max_len=32768 -dict=fuzz/dict/json.dict) ;;
    openai_request) extra=(-max_len=4096 -dict=fuzz/dict/json.dict) ;;
    chat_template) extra=(-max_len=4096 -dict=fuzz/dict/jinja.dict) ;;
    tokenizer) extra=(-max_len=4096) ;;
  esac
  mkdir -p "$BUILD/fuzz-corpus/$t" "$BUILD/fuzz-findings/$t"
  # -timeout: one input over 10 s is a finding (a hang); -rss_limit_mb: an
  # allocation of absurd size is one too; -malloc_limit_mb: so is one over 1 GiB.
  [[ -n "${FUZZ_RUNS:-}" ]] && extra+=(-runs="$FUZZ_RUNS")
  "$BUILD/fuzz/fuzz_$t" "${extra[@]}" -max_total_time="$SECS" -timeout=10 -rss_limit_mb=2560 \
    -malloc_limit_mb=1024 -print_final_stats=1 -artifact_prefix="$BUILD/fuzz-findings/$t/" \
    "$BUILD/fuzz-corpus/$t" "$BUILD/fuzz-seeds/$t" >"$BUILD/fuzz-logs/$t.log" 2>&1
}

pids=() names=()
status=0
for t in "${TARGETS[@]}"; do
  [[ -x "$BUILD/fuzz/fuzz_$t" ]] || { echo "fuzz: no target fuzz_$t" >&2; exit 2; }
  echo "fuzz: $t for ${SECS}s ..."
  run_one "$t" & pids+=($!) names+=("$t")
  if ((${#pids[@]} >= ${FUZZ_PARALLEL:-2})); then
    wait "${pids[0]}" || { echo "fuzz: FINDING in ${names[0]} (log $BUILD/fuzz-logs/${names[0]}.log)"; status=1; }
    pids=("${pids[@]:1}") names=("${names[@]:1}")
  fi
done
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { echo "fuzz: FINDING in ${names[$i]} (log $BUILD/fuzz-logs/${names[$i]}.log)"; status=1; }
done

printf '\n| target | seconds | executions | exec/s | corpus | findings |\n|---|---|---|---|---|---|\n'
for t in "${TARGETS[@]}"; do
  log="$BUILD/fuzz-logs/$t.log"
  execs=$(grep -o 'stat::number_of_executed_units: [0-9]*' "$log" | awk '{print $2}' | tail -1 || true)
  secs=$(grep -o 'Done [0-9]* runs in [0-9]* second' "$log" | awk '{print $5}' | tail -1 || true)
  corpus=$(find "$BUILD/fuzz-corpus/$t" -type f | wc -l)
  found=$(find "$BUILD/fuzz-findings/$t" -type f | wc -l)
  rate=$([[ -n "$execs" && -n "$secs" && "$secs" -gt 0 ]] && echo $((execs / secs)) || echo "-")
  printf '| %s | %s | %s | %s | %s | %s |\n' "$t" "${secs:--}" "${execs:--}" "$rate" "$corpus" "$found"
done
if ((status)); then
  echo "fuzz: findings (inputs in $BUILD/fuzz-findings/, logs in $BUILD/fuzz-logs/)" >&2
fi
exit $status
