#!/usr/bin/env bash
# Passkey retrieval grid on a GPU (docs/accuracy.md): one `oscar eval passkey --device cuda`
# per context length, each under its own time limit and with its own JSON and log, so a run
# cut short keeps every context that finished.
#
#   OSCAR=build/oscar MODEL=model.gguf HAYSTACK=data/haystack.txt OUT=out \
#     bash scripts/gpu_passkey.sh CTX:METHODS[:TRIALS] ...
#
#   CTX      context length in tokens
#   METHODS  the --methods list (bf16,int2-hadamard,oscar=calib.safetensors,...)
#   TRIALS   prompts per depth (default $TRIALS, 10)
# Environment: DEPTHS (default 0.1,0.3,0.5,0.7,0.9), CHUNK (prefill chunk, default 2048),
# LIMIT (seconds per context, default 600), CALIB (--calib for a bare "oscar"), TAG (file prefix),
# EXTRA (more `oscar eval passkey` flags, e.g. "--prompt-bf16 off").
# Writes $OUT/$TAG-passkey-CTX.json and .log; prints each context's summary and its time.
set -uo pipefail
OSCAR=${OSCAR:-build/oscar}
MODEL=${MODEL:?MODEL=path of the model}
HAYSTACK=${HAYSTACK:-data/haystack.txt}
OUT=${OUT:-out}
TAG=${TAG:-passkey}
DEPTHS=${DEPTHS:-0.1,0.3,0.5,0.7,0.9}
CHUNK=${CHUNK:-2048}
LIMIT=${LIMIT:-600}
TRIALS=${TRIALS:-10}
mkdir -p "$OUT"
rc=0
for spec in "$@"; do
  IFS=: read -r ctx methods trials <<< "$spec"
  trials=${trials:-$TRIALS}
  base=$OUT/$TAG-$ctx
  calib=()
  [[ -n ${CALIB:-} ]] && calib=(--calib "$CALIB")
  read -r -a extra <<< "${EXTRA:-}"
  echo "== passkey ctx $ctx, $trials prompts per depth ($DEPTHS), methods $methods"
  t0=$(date +%s)
  timeout "$LIMIT" "$OSCAR" eval passkey -m "$MODEL" "${calib[@]}" --haystack "$HAYSTACK" \
    --methods "$methods" --ctx "$ctx" --depths "$DEPTHS" --trials "$trials" --chunk "$CHUNK" \
    --device cuda "${extra[@]}" --json "$base.json" > "$base.txt" 2> "$base.log"
  r=$?
  echo "   exit $r after $(( $(date +%s) - t0 )) s"
  [[ $r -ne 0 ]] && { rc=$r; tail -3 "$base.log"; }
  sed -n '/^method .*accuracy/,$p' "$base.txt"
done
exit $rc
