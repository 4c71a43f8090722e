#!/usr/bin/env python3
"""Per-layer ablation of OSCAR calibration files (docs/accuracy.md, "Key transform").

    python3 scripts/calib_mix.py BASE OTHER OUT 0,1,2

OUT = BASE with the key side of the listed layers (k_rotation, k_eigenvalues, k_clip,
k_mean, k_scale) taken from OTHER; written as format version 2. Both files must be for
the same model and granularity. Needs numpy and safetensors (PyPI).
"""
import sys

from safetensors import safe_open
from safetensors.numpy import load_file, save_file


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    base, other, out = sys.argv[1:4]
    layers = [int(x) for x in sys.argv[4].split(",") if x]
    a, b = load_file(base), load_file(other)
    with safe_open(base, "np") as f:
        meta = dict(f.metadata())
    for l in layers:
        if f"layers.{l}.k_rotation" not in b:
            sys.exit(f"{other}: no layer {l}")
        if b[f"layers.{l}.k_rotation"].shape != a[f"layers.{l}.k_rotation"].shape:
            sys.exit(f"layer {l}: the two files have different rotation shapes (granularity)")
        for k in ["k_rotation", "k_eigenvalues", "k_clip", "k_mean", "k_scale"]:
            n = f"layers.{l}.{k}"
            if n in b:
                a[n] = b[n]
            elif n in a:
                del a[n]
    meta["format_version"] = "2"
    meta["key_transform"] = f"mixed: layers {sys.argv[4]} from {other}"
    save_file(a, out, metadata=meta)


if __name__ == "__main__":
    main()
