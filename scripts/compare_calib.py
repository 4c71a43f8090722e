#!/usr/bin/env python3
"""Compare two OSCAR calibration files (safetensors) tensor by tensor.

Rotations are compared as subspace-invariant quantities, since an eigenvector
is only defined up to sign (and near-degenerate eigenvalues mix): for each
rotation R_a, R_b: max |R_a - R_b| (raw), and the target reconstructions agree
if the eigenvalues agree. Reported per tensor family: max abs and max rel diff.
Usage: compare_calib.py A.safetensors B.safetensors
"""
import json, struct, sys
import numpy as np

DT = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I32": np.int32, "I64": np.int64,
      "U8": np.uint8, "I8": np.int8, "BF16": np.uint16}

def load(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
        data = f.read()
    out = {}
    for k, v in hdr.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        out[k] = np.frombuffer(data[a:b], dtype=DT[v["dtype"]]).reshape(v["shape"])
    return out, hdr.get("__metadata__", {})

A, ma = load(sys.argv[1])
B, mb = load(sys.argv[2])
assert A.keys() == B.keys(), "different tensor sets"
fam = {}
for k in sorted(A):
    a, b = A[k].astype(np.float64), B[k].astype(np.float64)
    f = k.split(".")[-1]
    d = np.abs(a - b).max() if a.size else 0.0
    r = d / max(np.abs(a).max(), 1e-300) if a.size else 0.0
    m = fam.setdefault(f, [0.0, 0.0, 0])
    m[0], m[1], m[2] = max(m[0], d), max(m[1], r), m[2] + 1
    # Rotations: subspace check. |R_a^T R_b| should be ~ identity up to signs.
    if "rotation" in f and a.ndim >= 2:
        d_ = a.shape[-1]
        for i, (ra, rb) in enumerate(zip(a.reshape(-1, d_, d_), b.reshape(-1, d_, d_))):
            c = np.abs(ra.T @ rb)
            dev = np.abs(c - np.eye(d_)).max()
            fam.setdefault(f + " |RaT Rb| - I", [0.0, 0.0, 0])
            g = fam[f + " |RaT Rb| - I"]
            g[0], g[2] = max(g[0], dev), g[2] + 1
print(f"{'tensor family':36s} {'count':>6s} {'max abs diff':>14s} {'max rel diff':>14s}")
for f, (d, r, n) in sorted(fam.items()):
    print(f"{f:36s} {n:6d} {d:14.3g} {r:14.3g}")
diff_meta = {k: (ma.get(k), mb.get(k)) for k in set(ma) | set(mb) if ma.get(k) != mb.get(k)}
print("metadata differences:", diff_meta if diff_meta else "none")
