#!/usr/bin/env bash
# The whole story on the default model (README's main command):
#   fetch the model and the texts -> calibrate OSCAR from the model ->
#   evaluate a short summary table against BF16 -> generate with the INT2 cache.
# Environment: BUILD_DIR (default build), MODEL, TOKENS (calibration tokens per
# file, default 8192), CTX (evaluation contexts, default 2048), METHODS.
#
# Two calibrations: out/calib.safetensors is `oscar calibrate`'s default, the
# setting the measurements of docs/accuracy.md recommend (one rotation per KV head,
# raw KᵀK / VᵀV targets, clips 0.88 / 0.84, key transform auto: the method "oscar");
# out/calib-paper.safetensors is the paper's setting (--preset paper: one rotation per
# layer, clips 0.96 / 0.92: the method "oscar=out/calib-paper.safetensors").
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
TOKENS=${TOKENS:-8192}
CTX=${CTX:-2048}
METHODS=${METHODS:-int2-naive,int2-hadamard,kivi2,oscar=out/calib-paper.safetensors,oscar}
OSCAR=$BUILD_DIR/oscar
BUILD_DIR=$BUILD_DIR bash scripts/build.sh  # incremental; installs what is missing
[[ -f $MODEL ]] || bash scripts/fetch_model.sh
bash scripts/fetch_text.sh
mkdir -p out

echo "== 1. calibrate ($TOKENS tokens of data/calib.txt): the default (recommended: per KV head, raw targets, clips 0.88/0.84) and the paper's setting"
"$OSCAR" calibrate -m "$MODEL" --text data/calib.txt --tokens "$TOKENS" -o out/calib.safetensors
"$OSCAR" calibrate -m "$MODEL" --text data/calib.txt --tokens "$TOKENS" --preset paper -o out/calib-paper.safetensors

echo "== 2. evaluate vs BF16 on held-out data/eval.txt (ctx $CTX)"
"$OSCAR" eval -m "$MODEL" --calib out/calib.safetensors --text data/eval.txt \
  --methods "$METHODS" --ctx "$CTX" --json out/eval.json
if python3 -c 'import matplotlib' 2>/dev/null; then
  python3 scripts/plot_eval.py out/eval.json -o out/eval.png
fi

echo "== 3. generate from a long prompt (~1300 tokens: the middle of the cache is INT2), BF16 vs OSCAR (the answers are compared in docs/accuracy.md)"
head -c 5000 data/haystack.txt > out/doc.txt
Q="According to the text above, why does Python use indentation for grouping statements?"
# oscar = the default (recommended) calibration; oscar=out/calib-paper.safetensors = the paper's setting
for kv in bf16 oscar oscar=out/calib-paper.safetensors; do
  echo "-- --kv $kv"
  "$OSCAR" generate -m "$MODEL" --kv "$kv" --calib out/calib.safetensors --chat -f out/doc.txt -p "$Q" -n 64
done
