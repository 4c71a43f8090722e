#!/usr/bin/env bash
# Fetches FlashInfer's CUDA headers (flashinfer-python 0.5.3 from PyPI, Apache-2.0; checksum
# verified) into .deps/flashinfer/include, and the CUTLASS headers the same wheel ships (BSD-3,
# for FlashInfer's Hopper prefill) into .deps/flashinfer/cutlass: the engine's comparison kernels
# (src/backend/cuda/flashinfer, docs/gpu-engine.md). Only header-only templates are used; nothing
# is installed. scripts/build.sh picks them up when present. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.deps/flashinfer
WHEEL=flashinfer_python-0.5.3-py3-none-any.whl
WHEEL_SHA=b601293b72f9138bad173edc28df84b9f239a013be974e2e79d4ba98aeb38cf5

source scripts/wheel.sh

if [[ -f "$DIR/include/flashinfer/attention/decode.cuh" && -d "$DIR/cutlass/include/cute" && -f "$DIR/VERSION" &&
      "$(cat "$DIR/VERSION")" == "$WHEEL_SHA" ]]; then
  echo "fetch_flashinfer: $DIR present"
  exit 0
fi
fetch_wheel "$DIR" "$WHEEL" "$WHEEL_SHA" flashinfer-python==0.5.3
rm -rf "$DIR/include.part" "$DIR/cutlass.part"
python3 - "$DIR/$WHEEL" "$DIR" <<'PY'
import os, sys, zipfile
whl, out = sys.argv[1:]
parts = {  # wheel prefix -> destination
    "flashinfer/data/include/": "include.part",
    "flashinfer/data/cutlass/include/": "cutlass.part/include",
    "flashinfer/data/cutlass/tools/util/include/": "cutlass.part/tools/util/include",
}
licences = {  # wheel file -> destination
    "flashinfer_python-0.5.3.dist-info/licenses/LICENSE": "include.part/LICENSE",
    "flashinfer/data/cutlass/LICENSE.txt": "cutlass.part/LICENSE.txt",
}
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if n.endswith("/"):
            continue
        dst = licences.get(n)
        for pre, d in parts.items():
            if n.startswith(pre):
                dst = os.path.join(d, n[len(pre):])
        if dst:
            dst = os.path.join(out, dst)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with z.open(n) as s, open(dst, "wb") as f:
                f.write(s.read())
PY
rm -rf "$DIR/include" "$DIR/cutlass"
mv "$DIR/include.part" "$DIR/include"
mv "$DIR/cutlass.part" "$DIR/cutlass"
echo "$WHEEL_SHA" > "$DIR/VERSION"
echo "fetch_flashinfer: $DIR/include ($(du -sh "$DIR/include" | cut -f1)), $DIR/cutlass ($(du -sh "$DIR/cutlass" | cut -f1))"
