#!/usr/bin/env bash
# The test command: builds (installing what is needed) and runs every CPU test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh "$@"
ctest --test-dir "${BUILD_DIR:-build}" --output-on-failure -j"$(nproc)"
