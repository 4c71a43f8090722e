#!/usr/bin/env bash
# Fetches calibration and evaluation text from Debian's package registry and
# builds two DISJOINT files (English prose + Python source code):
#   data/calib.txt  Python 3.11 tutorial + reference (prose) and stdlib modules A
#   data/eval.txt   Python 3.11 HOWTOs + FAQ (prose) and stdlib modules B
#   data/eval-code.txt  stdlib modules B alone (eval.txt's code half)
# Sources: python3.11-doc (the documentation's reStructuredText sources, PSF
# licence) and libpython3.11-stdlib (the standard library's .py files, PSF
# licence), fetched with `apt-get download` (apt verifies their checksums).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-data}
if [[ -s $OUT/calib.txt && -s $OUT/eval.txt && -s $OUT/eval-code.txt ]]; then
  echo "fetch_text: $OUT/calib.txt, $OUT/eval.txt and $OUT/eval-code.txt already present"; exit 0
fi
mkdir -p "$OUT/debs"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
( cd "$OUT/debs"
  if ! ls python3.11-doc_*.deb libpython3.11-stdlib_*.deb >/dev/null 2>&1; then
    [[ -n "$(find /var/lib/apt/lists -name '*Packages*' -print -quit 2>/dev/null)" ]] || apt-get update -qq
    apt-get download python3.11-doc libpython3.11-stdlib 2>&1 | grep -v '^W: Download is performed unsandboxed' || true
  fi )
for d in "$OUT"/debs/python3.11-doc_*.deb "$OUT"/debs/libpython3.11-stdlib_*.deb; do
  [[ -f $d ]] || { echo "fetch_text: download failed ($d)" >&2; exit 1; }
  dpkg -x "$d" "$work/x"
done
src=$work/x/usr/share/doc/python3.11/html/_sources
lib=$work/x/usr/lib/python3.11
cat_files() { for f in "$@"; do printf '\n\n'; cat "$f"; done; }
{
  cat_files $(ls "$src"/tutorial/*.rst.txt | sort) $(ls "$src"/reference/*.rst.txt | sort)
  cat_files "$lib"/json/*.py "$lib"/fractions.py "$lib"/numbers.py "$lib"/graphlib.py \
            "$lib"/statistics.py "$lib"/dataclasses.py "$lib"/shlex.py "$lib"/sched.py
} > "$OUT/calib.txt"
{
  cat_files $(ls "$src"/howto/*.rst.txt | sort) $(ls "$src"/faq/*.rst.txt | sort)
  cat_files "$lib"/difflib.py "$lib"/pprint.py "$lib"/queue.py "$lib"/gzip.py \
            "$lib"/shutil.py "$lib"/timeit.py "$lib"/secrets.py
} > "$OUT/eval.txt"
# The code half of eval.txt alone: its windows evaluate on Python source (eval.txt's first
# windows are the howto / faq prose).
cat_files "$lib"/difflib.py "$lib"/pprint.py "$lib"/queue.py "$lib"/gzip.py \
          "$lib"/shutil.py "$lib"/timeit.py "$lib"/secrets.py > "$OUT/eval-code.txt"
# A standalone prose-only file for passkey haystacks.
cat_files $(ls "$src"/faq/*.rst.txt | sort) > "$OUT/haystack.txt"
( cd "$OUT" && sha256sum calib.txt eval.txt eval-code.txt haystack.txt && wc -c calib.txt eval.txt eval-code.txt haystack.txt )
