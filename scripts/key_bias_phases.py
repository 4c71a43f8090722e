#!/usr/bin/env python3
"""Where a model's k_proj bias sits in RoPE frequency, and how far RoPE turns it.

For each layer and KV head with a key bias b (Qwen2 / Qwen2.5 GGUF files), prints ||b|| and the
share of ||b||^2 in the RoPE pairs (i, i + d/2) by the angle omega_i * CTX they turn through over
CTX positions. A share that turns less than 0.1 rad is a fixed offset: the calibrated key mean
removes it at every position. A share that turns more is an offset whose direction changes along
the context: a mean measured over the calibration's positions leaves a residual that grows with
the position (docs/accuracy.md, "Passkey retrieval on the GPU").

    python3 scripts/key_bias_phases.py MODEL.gguf [--ctx 32768] [--min-norm 20]

Standard library only; reads f32 bias tensors (what llama.cpp writes for biases).
"""
import argparse
import math
import struct

SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_gguf(path):
    f = open(path, "rb")

    def rd(fmt):
        return struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))

    def rstr():
        (n,) = rd("Q")
        return f.read(n).decode("utf-8", "replace")

    def rval(t):
        if t == 8:
            return rstr()
        if t == 9:
            et, n = rd("IQ")
            return [rval(et) for _ in range(n)]
        return rd(SCALARS[t])[0]

    if f.read(4) != b"GGUF":
        raise SystemExit(f"{path}: not a GGUF file")
    _, n_tensors, n_kv = rd("IQQ")
    kv = {}
    for _ in range(n_kv):
        key = rstr()
        (t,) = rd("I")
        kv[key] = rval(t)
    tensors = {}
    for _ in range(n_tensors):
        name = rstr()
        (nd,) = rd("I")
        dims = rd("Q" * nd)
        gtype, off = rd("IQ")
        tensors[name] = (dims, gtype, off)
    align = kv.get("general.alignment", 32)
    base = (f.tell() + align - 1) // align * align
    return f, kv, tensors, base


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=32768, help="positions the cache holds")
    ap.add_argument("--min-norm", type=float, default=20.0, help="print heads with ||b|| at least this")
    ap.add_argument("--calib-positions", type=int, default=2048,
                    help="positions [0, N) a fixed mean was measured over (the residual columns)")
    a = ap.parse_args()
    f, kv, tensors, base = read_gguf(a.model)
    arch = kv.get("general.architecture", "?")
    theta = kv.get(f"{arch}.rope.freq_base", 10000.0)
    n_layers = kv.get(f"{arch}.block_count", 0)
    n_kv = kv.get(f"{arch}.attention.head_count_kv", 0)
    if not n_kv or f"blk.0.attn_k.bias" not in tensors:
        raise SystemExit(f"{a.model}: no k_proj bias (architecture {arch})")
    bins = [(0.1, "< 0.1 rad"), (1.0, "0.1-1"), (2 * math.pi, "1-2π"), (math.inf, "> 2π")]
    print(f"{a.model}: {arch}, rope theta {theta:g}, {n_layers} layers, {n_kv} KV heads; "
          f"angle a pair turns through over {a.ctx} positions:")
    print(f"residual ||RoPE_t(b) - mean of RoPE_s(b) over s in [0, P)||: at t = 0 and t = {a.ctx - 1} with "
          f"P = {a.calib_positions}, and at t = {a.ctx - 1} with P = {a.ctx}")
    print(f"{'layer':>5} {'head':>4} {'||b||':>7}  " + "  ".join(f"{label:>9}" for _, label in bins) +
          f"  {'t=0':>9} {'t=end':>9} {'t=end,P=ctx':>11}")
    for layer in range(n_layers):
        dims, gtype, off = tensors[f"blk.{layer}.attn_k.bias"]
        if gtype != 0:
            raise SystemExit(f"blk.{layer}.attn_k.bias: ggml type {gtype}, only f32 is read")
        f.seek(base + off)
        b = struct.unpack(f"<{dims[0]}f", f.read(4 * dims[0]))
        d = dims[0] // n_kv
        for h in range(n_kv):
            bh = b[h * d:(h + 1) * d]
            total = sum(x * x for x in bh)
            if math.sqrt(total) < a.min_norm:
                continue
            share = [0.0] * len(bins)
            resid = [0.0, 0.0, 0.0]  # at t = 0 and t = ctx - 1 (mean over [0, P)), t = ctx - 1 (mean over [0, ctx))
            for i in range(d // 2):
                w = theta ** (-2.0 * i / d)
                e = bh[i] ** 2 + bh[i + d // 2] ** 2
                share[next(j for j, (hi, _) in enumerate(bins) if w * a.ctx < hi)] += e
                for n, (t, P) in enumerate(((0, a.calib_positions), (a.ctx - 1, a.calib_positions),
                                            (a.ctx - 1, a.ctx))):
                    mr, mi = mean_phase(w, P)
                    resid[n] += e * ((math.cos(w * t) - mr) ** 2 + (math.sin(w * t) - mi) ** 2)
            print(f"{layer:>5} {h:>4} {math.sqrt(total):>7.1f}  " +
                  "  ".join(f"{x / total:>9.3f}" for x in share) + "  " +
                  " ".join(f"{math.sqrt(r):>9.1f}" for r in resid))


def mean_phase(w, P):
    """The mean of e^{i w t} over t = 0 .. P-1 (the offset of one RoPE pair, averaged)."""
    if P <= 1 or abs(math.sin(w / 2)) < 1e-12:
        return 1.0, 0.0
    amp = math.sin(w * P / 2) / (P * math.sin(w / 2))
    return amp * math.cos(w * (P - 1) / 2), amp * math.sin(w * (P - 1) / 2)


if __name__ == "__main__":
    main()
