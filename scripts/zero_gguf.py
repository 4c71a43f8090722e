#!/usr/bin/env python3
"""A GGUF with the same metadata, tokenizer and tensor shapes as another, every tensor byte zero.

Timing runs on a GPU machine that the model cannot reach in one piece (64 MiB per device call) need
the shapes, not the values: the zeroed file compresses to ~2 MB (`xz`), and the engine runs the same
kernels on it (the 2-bit quantizer's zero-range guard keeps zero rows finite). A calibration made from
the real weights names their hash; --calib writes a copy with that hash blanked, so the zeroed model
accepts it (shapes and RoPE are still checked).

    python3 scripts/zero_gguf.py MODEL.gguf OUT.gguf [--calib CALIB.safetensors OUT_CALIB.safetensors]
    xz -T2 -3 OUT.gguf    # ~1.7 MB for Qwen2.5-Coder-1.5B-Instruct Q4_K_M (1.1 GB)
"""
import argparse
import json
import os
import struct

SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF scalar types


def data_offset(path):
    """Offset of the tensor data: after the header, the key/values and the tensor infos, aligned."""
    with open(path, "rb") as f:
        def rd(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]

        def rstr():
            return f.read(rd("Q"))

        if f.read(4) != b"GGUF":
            raise SystemExit(f"{path}: not a GGUF file")
        version, n_tensors, n_kv = rd("I"), rd("Q"), rd("Q")
        if version < 2:
            raise SystemExit(f"{path}: GGUF version {version} (2 or 3 expected)")
        align = 32
        for _ in range(n_kv):
            key, t = rstr(), rd("I")
            if t == 8:
                rstr()
            elif t == 9:
                et, n = rd("I"), rd("Q")
                if et == 8:
                    for _ in range(n):
                        rstr()
                else:
                    f.seek(SIZES[et] * n, 1)
            else:
                v = f.read(SIZES[t])
                if key == b"general.alignment":
                    align = struct.unpack("<I", v)[0]
        for _ in range(n_tensors):
            rstr()
            f.seek(8 * rd("I"), 1)
            rd("I"), rd("Q")
        return (f.tell() + align - 1) // align * align


def zero_gguf(src, dst):
    off, total = data_offset(src), os.path.getsize(src)
    with open(src, "rb") as f, open(dst, "wb") as o:
        o.write(f.read(off))
        left, block = total - off, bytes(1 << 24)
        while left > 0:
            n = min(left, len(block))
            o.write(block[:n])
            left -= n
    print(f"{dst}: {total} bytes, tensor data from {off} zeroed")


def blank_calibration_hash(src, dst):
    b = open(src, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    head = json.loads(b[8:8 + n])
    head.setdefault("__metadata__", {})["model.weights_hash"] = ""
    hb = json.dumps(head, separators=(",", ":")).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    with open(dst, "wb") as o:
        o.write(struct.pack("<Q", len(hb)) + hb + b[8 + n:])
    print(f"{dst}: calibration without the weights hash")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--calib", nargs=2, metavar=("CALIB", "OUT_CALIB"))
    a = ap.parse_args()
    zero_gguf(a.model, a.out)
    if a.calib:
        blank_calibration_hash(*a.calib)


if __name__ == "__main__":
    main()
