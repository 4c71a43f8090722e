#!/usr/bin/env python3
"""Writes tests/data/model/dequant.gguf and dequant_expected.safetensors.

dequant.gguf holds one small tensor per ggml type we dequantize (F32, F16,
BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) made of random block
bytes (fp16 scale fields replaced by finite random halves), plus metadata of
every GGUF value type. dequant_expected.safetensors holds, under the same
names, the fp32 values that gguf-py (llama.cpp's own Python package,
`pip install gguf`) dequantizes them to: an independent reference for
src/model/gguf_dequant.cpp. Deterministic (seed 7).
"""
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as T, GGUFWriter
from gguf.quants import dequantize
from safetensors.numpy import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "model")

# type -> (block elems, block bytes, byte offsets of fp16 fields)
LAYOUT = {
    T.Q4_0: (32, 18, [0]), T.Q4_1: (32, 20, [0, 2]), T.Q5_0: (32, 22, [0]), T.Q5_1: (32, 24, [0, 2]),
    T.Q8_0: (32, 34, [0]), T.Q4_K: (256, 144, [0, 2]), T.Q5_K: (256, 176, [0, 2]), T.Q6_K: (256, 210, [208]),
}


def main():
    rng = np.random.default_rng(7)
    w = GGUFWriter(os.path.join(OUT, "dequant.gguf"), "llama")
    w.add_uint8("test.u8", 200)
    w.add_int8("test.i8", -100)
    w.add_uint16("test.u16", 60000)
    w.add_int16("test.i16", -30000)
    w.add_uint32("test.u32", 4000000000)
    w.add_int32("test.i32", -2000000000)
    w.add_uint64("test.u64", 1 << 40)
    w.add_int64("test.i64", -(1 << 40))
    w.add_float32("test.f32", 1.5)
    w.add_float64("test.f64", -2.25)
    w.add_bool("test.bool", True)
    w.add_string("test.str", "héllo ✓")
    w.add_array("test.arr_str", ["a", "bc", "", "✓"])
    w.add_array("test.arr_int", [1, -2, 3])
    w.add_array("test.arr_f32", [0.5, -1.0])
    expected = {}
    rows, cols = 3, 512
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    w.add_tensor("t.F32", x)
    expected["t.F32"] = x
    h = x.astype(np.float16)
    w.add_tensor("t.F16", h)
    expected["t.F16"] = h.astype(np.float32)
    bf = ((x.view(np.uint32).astype(np.uint64) + 0x7FFF + ((x.view(np.uint32) >> 16) & 1)) >> 16).astype(np.uint16)
    w.add_tensor("t.BF16", bf, raw_dtype=T.BF16)
    expected["t.BF16"] = (bf.astype(np.uint32) << 16).view(np.float32)
    for ty, (be, bb, halves) in LAYOUT.items():
        nblk = rows * cols // be
        raw = rng.integers(0, 256, size=(nblk, bb), dtype=np.uint8)
        for off in halves:
            hv = (rng.standard_normal(nblk) * 0.05).astype(np.float16)
            raw[:, off:off + 2] = hv.view(np.uint8).reshape(nblk, 2)
        raw = raw.reshape(rows, cols // be * bb)
        name = f"t.{ty.name}"
        w.add_tensor(name, raw, raw_dtype=ty)
        expected[name] = dequantize(raw, ty).astype(np.float32).reshape(rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    save_file(expected, os.path.join(OUT, "dequant_expected.safetensors"))
    print("wrote dequant.gguf", os.path.getsize(os.path.join(OUT, "dequant.gguf")), "bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
