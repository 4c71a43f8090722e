#!/usr/bin/env bash
# The whole story on the default model (README's main command):
#   fetch the model and the texts -> calibrate OSCAR from the model ->
#   evaluate a short summary table against BF16 -> generate with the INT2 cache.
# Environment: BUILD_DIR (default build), MODEL, TOKENS (calibration tokens,
# default 16384), CTX (evaluation contexts, default 2048), METHODS.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
TOKENS=${TOKENS:-16384}
CTX=${CTX:-2048}
METHODS=${METHODS:-int2-naive,int2-hadamard,kivi2,oscar}
OSCAR=$BUILD_DIR/oscar
BUILD_DIR=$BUILD_DIR bash scripts/build.sh >/dev/null  # incremental; installs what is missing
[[ -f $MODEL ]] || bash scripts/fetch_model.sh
bash scripts/fetch_text.sh
mkdir -p out

echo "== 1. calibrate ($TOKENS tokens of data/calib.txt)"
"$OSCAR" calibrate -m "$MODEL" --text data/calib.txt --tokens "$TOKENS" -o out/calib.safetensors

echo "== 2. evaluate vs BF16 on held-out data/eval.txt (ctx $CTX)"
"$OSCAR" eval -m "$MODEL" --calib out/calib.safetensors --text data/eval.txt \
  --methods "$METHODS" --ctx "$CTX" --json out/eval.json
if python3 -c 'import matplotlib' 2>/dev/null; then
  python3 scripts/plot_eval.py out/eval.json -o out/eval.png
fi

echo "== 3. generate with the OSCAR INT2 KV cache"
"$OSCAR" generate -m "$MODEL" --kv oscar --calib out/calib.safetensors --chat \
  -p "Explain in a few sentences why a 2-bit KV cache needs a good rotation." -n 96
