#!/usr/bin/env bash
# Compares the device code of the CUDA kernels (every kernel of oscar_kernels_cuda) built from
# BASE_REV with that of the working tree (or of NEW_REV): per kernel, its SASS instructions
# with their encodings and its resource usage (registers, stack, shared, local, constant)
# must be identical. For moves of code between files, which must not change the device code.
#
#   bash scripts/sass_compare.sh BASE_REV [NEW_REV]
#
# Kernels are matched by their demangled names with the unnamed namespace and decode_impl::
# dropped: nvcc names an unnamed namespace after its file, and KernelArgs moved into
# decode_impl when decode_attention.cu was split. Only the names and the column padding of
# cuobjdump's listing are normalized, never the code. A kernel's static shared size includes
# the 1 KB reserved area whenever its file declares dynamic shared memory (extern __shared__),
# whatever the kernel itself uses, so a move to another file can change that number alone: such
# kernels are listed as notes and do not fail the comparison.
# CUDA_FLAGS="-D..." builds both with extra nvcc flags (e.g. -DOSCAR_CUDA_MIN_INSTANCES).
# WORK (default /tmp/sass_compare) holds the builds, the dumps and, for a kernel that differs,
# diff/<n>.diff. Needs nvcc (PATH or /usr/local/cuda/bin) and cuobjdump with nvdisasm (PATH,
# /usr/local/cuda/bin or CUOBJDUMP_DIR; pip's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm
# have them) and the main build's dependencies (scripts/setup.sh). Builds only the kernels'
# objects. Exit 0 when every kernel has the same instructions and the same resource usage
# (static shared size aside).
set -euo pipefail
BASE=${1:?usage: sass_compare.sh BASE_REV [NEW_REV]}
NEW=${2:-}
cd "$(dirname "$0")/.."
REPO=$PWD
WORK=${WORK:-/tmp/sass_compare}
export PATH=${CUOBJDUMP_DIR:+$CUOBJDUMP_DIR:}$PATH:/usr/local/cuda/bin
for tool in nvcc cuobjdump nvdisasm c++filt; do
  command -v "$tool" > /dev/null || { echo "sass_compare: $tool not found" >&2; exit 2; }
done
mkdir -p "$WORK"

# dump NAME SOURCE_DIR: configures and builds the kernels' objects, writes $WORK/NAME.sass/.res.
dump() {
  local name=$1 src=$2 build=$WORK/$1/build
  cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DOSCAR_BUILD_TESTS=OFF \
    -DOSCAR_BUILD_BENCH=OFF -DCMAKE_CUDA_FLAGS="${CUDA_FLAGS:-}" > "$WORK/$name.configure.log"
  local objs
  objs=$(ninja -C "$build" -t targets all | grep -oE '^CMakeFiles/oscar_kernels_cuda\.dir/[^:]*\.cu\.o' | sort -u)
  [[ -n $objs ]] || { echo "sass_compare: $name has no oscar_kernels_cuda objects (no nvcc?)" >&2; exit 2; }
  # shellcheck disable=SC2086  # one word per object
  ninja -C "$build" $objs > "$WORK/$name.build.log"
  : > "$WORK/$name.sass"
  : > "$WORK/$name.res"
  for o in $objs; do
    cuobjdump -sass "$build/$o" >> "$WORK/$name.sass"
    cuobjdump -res-usage "$build/$o" >> "$WORK/$name.res"
  done
}

tree() {  # REV NAME -> a source tree of REV under $WORK (kept while REV's tree is the same)
  local dir=$WORK/$2/src id
  id=$(git -C "$REPO" rev-parse "$1^{tree}")
  if [[ $(cat "$WORK/$2/tree" 2> /dev/null) != "$id" ]]; then
    rm -rf "$dir" "$WORK/$2/build"
    mkdir -p "$dir"
    git -C "$REPO" archive "$1" | tar -x -C "$dir"
    echo "$id" > "$WORK/$2/tree"
  fi
  echo "$dir"
}

dump base "$(tree "$BASE" base)"
if [[ -n $NEW ]]; then
  dump new "$(tree "$NEW" new)"
else
  dump new "$REPO"
fi

python3 - "$WORK" "$BASE" "${NEW:-working tree}" <<'EOF'
import difflib, re, subprocess, sys
from pathlib import Path

work, base_rev, new_rev = Path(sys.argv[1]), sys.argv[2], sys.argv[3]

def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
    return out.stdout.splitlines()

def normalize(name):
    return name.replace("(anonymous namespace)::", "").replace("decode_impl::", "")

def parse(side):
    """{normalized kernel name: (SASS lines, resource usage line)}"""
    code, res, cur = {}, {}, None
    for line in (work / f"{side}.sass").read_text().splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = m.group(1)
            code[cur] = []
        elif line.strip().startswith(("Fatbin", "code for")):
            cur = None  # the next object's (or architecture's) header
        elif cur and line.strip():
            code[cur].append(" ".join(line.split()))  # cuobjdump pads to the widest line of its dump
    lines = (work / f"{side}.res").read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s*Function (\S+):$", line)
        if m:
            res[m.group(1)] = lines[i + 1].strip()
    names = sorted(code)
    out = {}
    for mangled, pretty in zip(names, demangle(names)):
        key = normalize(pretty)
        if key in out:
            sys.exit(f"sass_compare: two {side} kernels are both named {key}")
        out[key] = (code[mangled], res.get(mangled, "?"))
    return out

base, new = parse("base"), parse("new")
diffdir = work / "diff"
diffdir.mkdir(exist_ok=True)
for f in diffdir.glob("*.diff"):
    f.unlink()
def without_shared(r):
    return re.sub(r"SHARED:\d+ ", "", r)

same, notes, bad = 0, 0, 0
for i, key in enumerate(sorted(set(base) | set(new))):
    if key not in new or key not in base:
        print(f"ONLY IN {'BASE' if key in base else 'NEW'}: {key}")
        bad += 1
        continue
    (bc, br), (nc, nr) = base[key], new[key]
    if bc == nc and br == nr:
        same += 1
        continue
    if bc == nc and without_shared(br) == without_shared(nr):
        notes += 1
        print(f"note, static shared size only (instructions identical): {key}\n  base {br}\n  new  {nr}")
        continue
    bad += 1
    print(f"DIFFERS: {key}\n  base {br}\n  new  {nr}")
    (diffdir / f"{i}.diff").write_text(key + "\n" + "\n".join(difflib.unified_diff(bc, nc, "base", "new", lineterm="")))
n = len(set(base) | set(new))
print(f"sass_compare: {base_rev} vs {new_rev}: {n} kernels; {same + notes} with identical instructions and "
      f"encodings, {same} of them with identical resource usage too, {notes} differing only in static shared "
      f"size; {bad} differ or are missing")
sys.exit(1 if bad else 0)
EOF
