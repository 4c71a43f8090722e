#!/usr/bin/env bash
# Fetches FlashInfer's CUDA headers (flashinfer-python 0.5.3 from PyPI, Apache-2.0; checksum
# verified) into .deps/flashinfer/include, for the engine's BF16 decode baseline on FlashInfer's
# kernel (src/backend/cuda/flashinfer, docs/gpu-engine.md). Only the header-only templates are
# used; nothing is installed. scripts/build.sh picks them up when present. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=.deps/flashinfer
WHEEL=flashinfer_python-0.5.3-py3-none-any.whl
WHEEL_SHA=b601293b72f9138bad173edc28df84b9f239a013be974e2e79d4ba98aeb38cf5

check() { echo "$2  $1" | sha256sum -c --quiet - 2>/dev/null; }

if [[ -f "$DIR/include/flashinfer/attention/decode.cuh" && -f "$DIR/VERSION" && "$(cat "$DIR/VERSION")" == "$WHEEL_SHA" ]]; then
  echo "fetch_flashinfer: $DIR/include present"
  exit 0
fi
mkdir -p "$DIR"
if ! { [[ -f "$DIR/$WHEEL" ]] && check "$DIR/$WHEEL" "$WHEEL_SHA"; }; then
  rm -f "$DIR/$WHEEL"
  python3 -m pip download --no-deps --only-binary=:all: -d "$DIR" flashinfer-python==0.5.3
fi
if ! check "$DIR/$WHEEL" "$WHEEL_SHA"; then
  echo "fetch_flashinfer: $DIR/$WHEEL: sha256 mismatch (expected $WHEEL_SHA)" >&2
  exit 1
fi
rm -rf "$DIR/include.part"
python3 - "$DIR/$WHEEL" "$DIR/include.part" <<'PY'
import os, sys, zipfile
whl, out = sys.argv[1:]
prefix = "flashinfer/data/include/"
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if n.startswith(prefix) and not n.endswith("/"):
            dst = os.path.join(out, n[len(prefix):])
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with z.open(n) as s, open(dst, "wb") as d:
                d.write(s.read())
        elif n.endswith("dist-info/licenses/LICENSE") or n.endswith("dist-info/LICENSE"):
            os.makedirs(out, exist_ok=True)
            with z.open(n) as s, open(os.path.join(out, "LICENSE"), "wb") as d:
                d.write(s.read())
PY
rm -rf "$DIR/include"
mv "$DIR/include.part" "$DIR/include"
echo "$WHEEL_SHA" > "$DIR/VERSION"
echo "fetch_flashinfer: $DIR/include ($(du -sh "$DIR/include" | cut -f1))"
