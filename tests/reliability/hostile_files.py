#!/usr/bin/env python3
"""Hostile files through the real `oscar` command (docs/reliability.md).

Builds a small valid GGUF model, a Hugging Face directory (tests/data/model/tiny-llama),
a calibration file and an activation dump; checks that each loads (the controls: a
case whose control fails makes the whole matrix fail, so a broken base file cannot make
every hostile case "pass"). Then each hostile case — truncated, corrupted,
oversized-dimension and wrong-type files, calibrations for another model or head_dim,
NaN/Inf in weights or calibrations, a model larger than the memory budget — runs the
command that reads it and must give:
  * exit status 1 (not a signal: no crash, no abort, no sanitizer report),
  * a last stderr line "oscar <cmd>: error: ..." containing the expected words,
  * nothing else alarming on stderr ("terminate called", "Sanitizer", "runtime error"),
  * within the time limit (no hang) and under the memory limit (no absurd allocation).

  hostile_files.py --oscar build/oscar [--table] [--keep DIR] [-k SUBSTRING]
--table prints the matrix (case, command, message) as Markdown.
"""
import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

SRC = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_HF = os.path.join(SRC, "tests", "data", "model", "tiny-llama")

# ---------------------------------------------------------------------------
# GGUF writer (v3, little endian) with hooks for precise corruption.
U32, I32, F32, BOOL, STRING, ARRAY, U64 = 4, 5, 6, 7, 8, 9, 10


def gstr(s):
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def gvalue(vtype, v):
    if vtype == U32:
        return struct.pack("<I", v)
    if vtype == I32:
        return struct.pack("<i", v)
    if vtype == F32:
        return struct.pack("<f", v)
    if vtype == BOOL:
        return struct.pack("<B", 1 if v else 0)
    if vtype == STRING:
        return gstr(v)
    if vtype == U64:
        return struct.pack("<Q", v)
    if vtype == ARRAY:
        etype, items = v
        return struct.pack("<IQ", etype, len(items)) + b"".join(gvalue(etype, x) for x in items)
    raise ValueError(vtype)


class Gguf:
    def __init__(self):
        self.kv = []       # [key, vtype, value]
        self.tensors = []  # [name, shape outermost-first, ggml type, bytes]
        self.version = 3
        self.magic = b"GGUF"
        self.n_tensors = None  # override the count in the header
        self.offset_override = {}
        self.dims_override = {}
        self.type_override = {}

    def set_kv(self, key, vtype, value):
        for e in self.kv:
            if e[0] == key:
                e[1], e[2] = vtype, value
                return
        self.kv.append([key, vtype, value])

    def tensor(self, name, shape, data):
        self.tensors.append([name, list(shape), 0, struct.pack("<%df" % len(data), *data)])

    def bytes(self):
        out = self.magic + struct.pack("<IQQ", self.version,
                                       len(self.tensors) if self.n_tensors is None else self.n_tensors,
                                       len(self.kv))
        for key, vtype, value in self.kv:
            out += gstr(key) + struct.pack("<I", vtype) + gvalue(vtype, value)
        off, offs = 0, []
        for name, shape, gtype, data in self.tensors:
            ne = self.dims_override.get(name, list(reversed(shape)))
            out += gstr(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
            out += struct.pack("<IQ", self.type_override.get(name, gtype), self.offset_override.get(name, off))
            offs.append(off)
            off = (off + len(data) + 31) // 32 * 32
        out += b"\0" * ((-len(out)) % 32)
        base = len(out)
        for (name, shape, gtype, data), o in zip(self.tensors, offs):
            out += b"\0" * (base + o - len(out)) + data
        return out


def tiny_gguf():
    """A 2-layer llama (hidden 128, 2 query / 1 KV heads of 64, FFN 128) with the tiny test tokenizer."""
    tok = json.load(open(os.path.join(TINY_HF, "tokenizer.json")))
    vocab = tok["model"]["vocab"]
    tokens = [""] * (max(vocab.values()) + 1)
    types = [1] * len(tokens)
    for t, i in vocab.items():
        tokens[i] = t
    for a in tok["added_tokens"]:
        while a["id"] >= len(tokens):
            tokens.append("")
            types.append(1)
        tokens[a["id"]] = a["content"]
        types[a["id"]] = 3 if a.get("special") else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    g = Gguf()
    H, F, hd, nq, nkv, L, V = 128, 128, 64, 2, 1, 2, len(tokens)
    for k, t, v in [("general.architecture", STRING, "llama"), ("general.name", STRING, "hostile-base"),
                    ("llama.block_count", U32, L), ("llama.context_length", U32, 512),
                    ("llama.embedding_length", U32, H), ("llama.feed_forward_length", U32, F),
                    ("llama.attention.head_count", U32, nq), ("llama.attention.head_count_kv", U32, nkv),
                    ("llama.rope.freq_base", F32, 10000.0),
                    ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5),
                    ("tokenizer.ggml.model", STRING, "gpt2"), ("tokenizer.ggml.pre", STRING, "llama-bpe"),
                    ("tokenizer.ggml.tokens", ARRAY, (STRING, tokens)),
                    ("tokenizer.ggml.token_type", ARRAY, (I32, types)),
                    ("tokenizer.ggml.merges", ARRAY, (STRING, merges)),
                    ("tokenizer.ggml.bos_token_id", U32, 1), ("tokenizer.ggml.eos_token_id", U32, 2)]:
        g.set_kv(k, t, v)
    seed = [12345]

    def rnd(n, scale=0.2, offset=0.0):
        out = []
        for _ in range(n):
            seed[0] = (seed[0] * 1103515245 + 12345) % 2**31
            out.append(offset + scale * (seed[0] / 2**31 - 0.5))
        return out
    g.tensor("token_embd.weight", [V, H], rnd(V * H))
    g.tensor("output_norm.weight", [H], rnd(H, 0.1, 1.0))
    for l in range(L):
        b = "blk.%d." % l
        g.tensor(b + "attn_norm.weight", [H], rnd(H, 0.1, 1.0))
        g.tensor(b + "attn_q.weight", [nq * hd, H], rnd(nq * hd * H))
        g.tensor(b + "attn_k.weight", [nkv * hd, H], rnd(nkv * hd * H))
        g.tensor(b + "attn_v.weight", [nkv * hd, H], rnd(nkv * hd * H))
        g.tensor(b + "attn_output.weight", [H, nq * hd], rnd(H * nq * hd))
        g.tensor(b + "ffn_norm.weight", [H], rnd(H, 0.1, 1.0))
        g.tensor(b + "ffn_gate.weight", [F, H], rnd(F * H))
        g.tensor(b + "ffn_up.weight", [F, H], rnd(F * H))
        g.tensor(b + "ffn_down.weight", [H, F], rnd(H * F))
    return g


# ---------------------------------------------------------------------------
# safetensors (read and write, for calibration files, dumps and HF shards)
def st_read(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def st_write(path, header, data):
    h = json.dumps(header, separators=(",", ":")).encode()
    open(path, "wb").write(struct.pack("<Q", len(h)) + h + data)


def st_build(tensors, metadata=None):
    """tensors: list of (name, shape, list of floats) -> (header, data), F32."""
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, shape, vals in tensors:
        b = struct.pack("<%df" % len(vals), *vals)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    return header, data


def st_set_floats(path, name, fn):
    """Rewrites tensor `name` (F32) of a safetensors file in place with fn(values)."""
    header, data = st_read(path)
    b, e = header[name]["data_offsets"]
    vals = list(struct.unpack("<%df" % ((e - b) // 4), data[b:e]))
    vals = fn(vals)
    data = data[:b] + struct.pack("<%df" % len(vals), *vals) + data[e:]
    st_write(path, header, data)


def dump_tensors(layers=2, T=6, hq=2, hkv=1, d=64, skip=None, t_override=None):
    out, x = [], 0.0
    for l in range(layers):
        for w, h in (("q", hq), ("k", hkv), ("v", hkv)):
            name = "layers.%d.%s" % (l, w)
            if name == skip:
                continue
            t = t_override.get(name, T) if t_override else T
            vals = []
            for _ in range(t * h * d):
                x += 0.37
                vals.append(math.sin(x))
            out.append((name, [t, h, d], vals))
    return out


# ---------------------------------------------------------------------------
class Case:
    def __init__(self, name, what, make, argv, expect, env=None, control=False):
        self.name, self.what, self.make, self.argv, self.expect = name, what, make, argv, expect
        self.env, self.control = env or {}, control


def run(oscar, argv, env, timeout):
    """Runs one command; returns (exit status or None on timeout, stdout, stderr, seconds, max RSS MiB)."""
    e = dict(os.environ)
    e.update(env)
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe:
        t0 = time.time()
        p = subprocess.Popen([oscar] + argv, stdout=fo, stderr=fe, env=e)
        rc, rss_mb = None, 0.0
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                rc, rss_mb = os.waitstatus_to_exitcode(status), ru.ru_maxrss / 1024
                p.returncode = rc
                break
            if time.time() - t0 > timeout:
                p.kill()
                os.wait4(p.pid, 0)
                p.returncode = -9
                break
            time.sleep(0.01)
        secs = time.time() - t0
        fo.seek(0)
        fe.seek(0)
        return rc, fo.read().decode(errors="replace"), fe.read().decode(errors="replace"), secs, rss_mb


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--oscar", required=True)
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--keep", help="write the files here and keep them")
    ap.add_argument("-k", help="only cases whose name contains this")
    ap.add_argument("--timeout", type=float, default=120)
    ap.add_argument("--max-rss-mb", type=float, default=3072)
    args = ap.parse_args()
    work = args.keep or tempfile.mkdtemp(prefix="oscar-hostile-")
    os.makedirs(work, exist_ok=True)
    P = lambda *a: os.path.join(work, *a)

    # Base files.
    base = tiny_gguf()
    open(P("model.gguf"), "wb").write(base.bytes())
    open(P("calib.txt"), "w").write(("The quick brown fox jumps over the lazy dog. " * 40))
    gen = ["generate", "-n", "2", "-p", "hello", "-q", "-t", "1"]

    def gguf_case(name, what, mutate, expect, env=None):
        def make(path=P(name + ".gguf")):
            g = tiny_gguf()
            raw = mutate(g)
            open(path, "wb").write(raw if raw is not None else g.bytes())
        return Case(name, what, make, gen + ["-m", P(name + ".gguf")], expect, env)

    def raw_case(name, what, fn, expect):
        def make():
            open(P(name + ".gguf"), "wb").write(fn(base.bytes()))
        return Case(name, what, make, gen + ["-m", P(name + ".gguf")], expect)

    def hf_case(name, what, mutate, expect):
        def make():
            d = P(name)
            shutil.rmtree(d, ignore_errors=True)
            shutil.copytree(TINY_HF, d)
            mutate(d)
        return Case(name, what, make, gen + ["-m", P(name)], expect)

    def calib_case(name, what, mutate, expect, src="calib.safetensors"):
        def make():
            shutil.copy(P(src), P(name + ".safetensors"))
            mutate(P(name + ".safetensors"))
        return Case(name, what, make,
                    gen + ["-m", P("model.gguf"), "--kv", "oscar", "--calib", P(name + ".safetensors")], expect)

    def dump_case(name, what, tensors, expect, raw=None):
        def make():
            h, d = st_build(tensors, {"model.architecture": "llama"})
            st_write(P(name + ".safetensors"), h, d)
            if raw:
                b = open(P(name + ".safetensors"), "rb").read()
                open(P(name + ".safetensors"), "wb").write(raw(b))
        return Case(name, what, make, ["calibrate", "-q", "-a", P(name + ".safetensors"), "-o", P(name + ".out")],
                    expect)

    def set_meta(path, key, value):
        h, d = st_read(path)
        h["__metadata__"][key] = value
        st_write(path, h, d)

    def shard_header(d, fn):
        p = os.path.join(d, "model-00001-of-00002.safetensors")
        h, data = st_read(p)
        fn(h)
        st_write(p, h, data)

    def first_tensor(h):
        return sorted(k for k in h if k != "__metadata__")[0]

    def edit_json(path, fn):
        j = json.load(open(path))
        fn(j)
        json.dump(j, open(path, "w"))

    def drop(g, name):
        g.tensors = [t for t in g.tensors if t[0] != name]

    def reshape(g, name, shape):
        t = next(t for t in g.tensors if t[0] == name)
        t[1] = shape
        t[3] = struct.pack("<%df" % math.prod(shape), *([0.01] * math.prod(shape)))

    def nan_weight(g, value):
        name, shape, gtype, data = g.tensors[3]
        vals = list(struct.unpack("<%df" % (len(data) // 4), data))
        vals[5] = value
        g.tensors[3][3] = struct.pack("<%df" % len(vals), *vals)

    cases = [
        # ---- controls (must succeed) ----
        Case("control-gguf", "valid tiny GGUF model", lambda: None, gen + ["-m", P("model.gguf")], None,
             control=True),
        Case("control-hf", "valid Hugging Face directory (tests/data/model/tiny-llama)", lambda: None,
             gen + ["-m", TINY_HF], None, control=True),
        Case("control-calibrate", "calibrate the tiny GGUF from a text",
             lambda: None, ["calibrate", "-q", "-m", P("model.gguf"), "--text", P("calib.txt"), "--tokens", "128",
                            "--chunk", "64", "-o", P("calib.safetensors")], None, control=True),
        Case("calibrate-bad-preset", "calibrate with an unknown --preset", lambda: None,
             ["calibrate", "-q", "-m", P("model.gguf"), "--text", P("calib.txt"), "--tokens", "128",
              "--preset", "fastest", "-o", P("calib-bad.safetensors")], "expected recommended or paper"),
        Case("calibrate-bad-positions", "calibrate with --positions -5", lambda: None,
             ["calibrate", "-q", "-m", P("model.gguf"), "--text", P("calib.txt"), "--tokens", "128",
              "--positions", "-5", "-o", P("calib-bad.safetensors")], "--positions"),
        Case("control-calib", "generate with that calibration", lambda: None,
             gen + ["-m", P("model.gguf"), "--kv", "oscar", "--calib", P("calib.safetensors")], None, control=True),
        # Every head centred: the file has page centering (k_rope_mean, rope_freq; format 3).
        Case("control-calibrate-pc", "calibrate with --key-transform center (page centering)",
             lambda: None, ["calibrate", "-q", "-m", P("model.gguf"), "--text", P("calib.txt"), "--tokens", "128",
                            "--chunk", "64", "--key-transform", "center", "-o", P("calib-pc.safetensors")], None,
             control=True),
        Case("control-calib-pc", "generate with that calibration", lambda: None,
             gen + ["-m", P("model.gguf"), "--kv", "oscar", "--calib", P("calib-pc.safetensors")], None, control=True),
        Case("calibrate-bad-page-center", "calibrate with --page-center maybe", lambda: None,
             ["calibrate", "-q", "-m", P("model.gguf"), "--text", P("calib.txt"), "--tokens", "128",
              "--page-center", "maybe", "-o", P("calib-bad.safetensors")], "--page-center"),
        dump_case("control-dump", "valid activation dump", dump_tensors(), None),
        # ---- GGUF ----
        raw_case("gguf-empty", "empty file", lambda b: b"", "truncated"),
        raw_case("gguf-trunc-header", "cut inside the header (10 bytes)", lambda b: b[:10], "truncated"),
        raw_case("gguf-trunc-metadata", "cut inside the metadata", lambda b: b[:2000], "truncated"),
        raw_case("gguf-trunc-data", "last tensor's data cut short", lambda b: b[:-100], "truncated"),
        raw_case("gguf-bad-magic", "magic 'GGML'", lambda b: b"GGML" + b[4:], "bad magic"),
        raw_case("gguf-version", "version 99", lambda b: b[:4] + struct.pack("<I", 99) + b[8:], "version 99"),
        raw_case("gguf-huge-tensor-count", "tensor count 2^62",
                 lambda b: b[:8] + struct.pack("<Q", 2**62) + b[16:], "corrupt header"),
        raw_case("gguf-huge-kv-count", "metadata count 2^62",
                 lambda b: b[:16] + struct.pack("<Q", 2**62) + b[24:], "corrupt header"),
        raw_case("gguf-huge-string", "first key's length 2^60",
                 lambda b: b[:24] + struct.pack("<Q", 2**60) + b[32:], "truncated"),
        raw_case("gguf-zero-fill", "every byte zero", lambda b: b"\0" * len(b), "bad magic"),
        gguf_case("gguf-dims-overflow", "a tensor of 2^40 x 2^40 elements",
                  lambda g: g.dims_override.update({"blk.0.attn_q.weight": [2**40, 2**40]}), "larger than the file"),
        gguf_case("gguf-dim-zero", "a tensor dimension of 0",
                  lambda g: g.dims_override.update({"output_norm.weight": [0]}), "invalid dimension"),
        gguf_case("gguf-offset-past-end", "a tensor offset past the end of the file",
                  lambda g: g.offset_override.update({"blk.1.ffn_down.weight": 2**40}), "truncated"),
        gguf_case("gguf-offset-unaligned", "a tensor offset not aligned",
                  lambda g: g.offset_override.update({"blk.1.ffn_down.weight": 3}), "aligned"),
        gguf_case("gguf-unknown-type", "tensor type 99",
                  lambda g: g.type_override.update({"token_embd.weight": 99}), "unknown tensor type"),
        gguf_case("gguf-wrong-kv-type", "block_count stored as a string",
                  lambda g: g.set_kv("llama.block_count", STRING, "two"), "expected an integer"),
        gguf_case("gguf-absurd-layers", "block_count 10^9",
                  lambda g: g.set_kv("llama.block_count", U32, 10**9), "block_count"),
        gguf_case("gguf-absurd-hidden", "embedding_length 2^31-1 (tensors disagree)",
                  lambda g: g.set_kv("llama.embedding_length", U32, 2**31 - 1), "error"),
        gguf_case("gguf-zero-heads", "head_count 0",
                  lambda g: g.set_kv("llama.attention.head_count", U32, 0), "error"),
        gguf_case("gguf-gqa-mismatch", "3 KV heads for 2 query heads",
                  lambda g: g.set_kv("llama.attention.head_count_kv", U32, 3), "error"),
        gguf_case("gguf-missing-tensor", "blk.1.ffn_up.weight absent",
                  lambda g: drop(g, "blk.1.ffn_up.weight"),
                  "missing tensor"),
        gguf_case("gguf-wrong-shape", "attn_k.weight with an extra row",
                  lambda g: reshape(g, "blk.0.attn_k.weight", [65, 128]), "shape"),
        gguf_case("gguf-nan-weight", "a NaN in a weight", lambda g: nan_weight(g, float("nan")),
                  "non-finite"),
        gguf_case("gguf-inf-weight", "an Inf in a weight", lambda g: nan_weight(g, float("inf")), "non-finite"),
        gguf_case("gguf-bad-arch", "architecture 'gpt-j'", lambda g: g.set_kv("general.architecture", STRING, "gptj"),
                  "unsupported architecture"),
        gguf_case("gguf-eos-out-of-range", "eos token id 10^6",
                  lambda g: g.set_kv("tokenizer.ggml.eos_token_id", U32, 10**6), "out of range"),
        gguf_case("gguf-token-types-short", "token_type shorter than tokens",
                  lambda g: g.set_kv("tokenizer.ggml.token_type", ARRAY, (I32, [1, 1, 1])), "token_type"),
        gguf_case("gguf-too-large-for-memory", "model larger than the memory budget (OSCAR_HOST_MEMORY_LIMIT=64K)",
                  lambda g: None, "host memory", env={"OSCAR_HOST_MEMORY_LIMIT": "64K"}),
        # ---- Hugging Face directory (safetensors shards, config, tokenizer) ----
        hf_case("hf-header-length", "shard header length larger than the file",
                lambda d: open(os.path.join(d, "model-00001-of-00002.safetensors"), "r+b").write(
                    struct.pack("<Q", 2**50)), "header"),
        hf_case("hf-header-json", "shard header not JSON",
                lambda d: open(os.path.join(d, "model-00001-of-00002.safetensors"), "r+b").write(
                    struct.pack("<Q", 100) + b"{{{{" + b" " * 96), "JSON"),
        hf_case("hf-offsets-past-end", "data_offsets past the end",
                lambda d: shard_header(d, lambda h: h[first_tensor(h)].__setitem__("data_offsets", [0, 2**40])),
                "error"),
        hf_case("hf-overlap", "two tensors share bytes",
                lambda d: shard_header(d, lambda h: h[sorted(k for k in h if k != "__metadata__")[1]].__setitem__(
                    "data_offsets", h[first_tensor(h)]["data_offsets"])), "error"),
        hf_case("hf-dtype", "dtype 'Q9'",
                lambda d: shard_header(d, lambda h: h[first_tensor(h)].__setitem__("dtype", "Q9")), "dtype"),
        hf_case("hf-shape-vs-bytes", "shape disagrees with byte length",
                lambda d: shard_header(d, lambda h: h[first_tensor(h)].__setitem__("shape", [3, 5])), "error"),
        hf_case("hf-config-json", "config.json truncated",
                lambda d: open(os.path.join(d, "config.json"), "w").write('{"hidden_size": 3'), "config"),
        hf_case("hf-config-hidden", "config hidden_size disagrees with the tensors",
                lambda d: edit_json(os.path.join(d, "config.json"), lambda j: j.__setitem__("hidden_size", 48)),
                "shape"),
        hf_case("hf-config-type", "config num_attention_heads is a string",
                lambda d: edit_json(os.path.join(d, "config.json"),
                                    lambda j: j.__setitem__("num_attention_heads", "four")), "config"),
        hf_case("hf-shard-escape", "index maps a tensor to ../outside.safetensors",
                lambda d: edit_json(os.path.join(d, "model.safetensors.index.json"),
                                    lambda j: j["weight_map"].__setitem__(next(iter(j["weight_map"])),
                                                                          "../outside.safetensors")),
                "leaves the directory"),
        hf_case("hf-tokenizer-json", "tokenizer.json truncated",
                lambda d: open(os.path.join(d, "tokenizer.json"), "r+").truncate(500), "tokenizer.json"),
        # ---- calibration files ----
        calib_case("calib-truncated", "cut in half",
                   lambda p: open(p, "r+b").truncate(os.path.getsize(p) // 2), "truncated"),
        calib_case("calib-other-layers", "for a 3-layer model", lambda p: set_meta(p, "model.n_layers", "3"),
                   "layers"),
        calib_case("calib-other-head-dim", "for head_dim 128", lambda p: set_meta(p, "model.head_dim", "128"),
                   "shape"),
        calib_case("calib-other-model", "another model's weights hash",
                   lambda p: set_meta(p, "model.weights_hash", "0123456789abcdef0123456789abcdef"), "different model"),
        calib_case("calib-other-kv-heads", "for 2 KV heads", lambda p: set_meta(p, "model.n_kv_heads", "2"),
                   "error"),
        calib_case("calib-nan-rotation", "NaN in a key rotation",
                   lambda p: st_set_floats(p, "layers.0.k_rotation", lambda v: [float("nan")] + v[1:]),
                   "non-finite"),
        calib_case("calib-inf-clip", "Inf clip ratio",
                   lambda p: st_set_floats(p, "layers.1.v_clip", lambda v: [float("inf")] * len(v)), "non-finite"),
        calib_case("calib-not-orthogonal", "a rotation scaled by 2",
                   lambda p: st_set_floats(p, "layers.0.v_rotation", lambda v: [2 * x for x in v]), "orthogonal"),
        calib_case("calib-clip-range", "clip ratio 1.5",
                   lambda p: st_set_floats(p, "layers.0.k_clip", lambda v: [1.5] * len(v)), "clip"),
        calib_case("calib-pc-other-rope", "page centering for other RoPE frequencies",
                   lambda p: st_set_floats(p, "rope_freq", lambda v: [x * 0.5 for x in v]), "different RoPE",
                   src="calib-pc.safetensors"),
        calib_case("calib-pc-rope-range", "a RoPE frequency of 9",
                   lambda p: st_set_floats(p, "rope_freq", lambda v: [9.0] + v[1:]), "rope_freq",
                   src="calib-pc.safetensors"),
        calib_case("calib-pc-nan-mean", "NaN in a page-centering mean",
                   lambda p: st_set_floats(p, "layers.0.k_rope_mean", lambda v: [float("nan")] + v[1:]),
                   "non-finite", src="calib-pc.safetensors"),
        calib_case("calib-pc-old-version", "page centering in a file that says format version 2",
                   lambda p: set_meta(p, "format_version", "2"), "format version 3", src="calib-pc.safetensors"),
        calib_case("calib-format", "format metadata of another file kind",
                   lambda p: set_meta(p, "format", "something-else"), "format"),
        # ---- activation dumps ----
        dump_case("dump-layer-gap", "layers 0 and 2 but no layer 1",
                  [t for t in dump_tensors(3) if not t[0].startswith("layers.1.")], "layer"),
        dump_case("dump-missing-v", "layer 1 without v", dump_tensors(skip="layers.1.v"), "layers.1.v"),
        dump_case("dump-token-mismatch", "k of layer 0 has fewer tokens",
                  dump_tensors(t_override={"layers.0.k": 5}), "error"),
        dump_case("dump-truncated", "cut inside the data", dump_tensors(), "truncated",
                  raw=lambda b: b[:len(b) - 64]),
        dump_case("dump-nan", "a NaN activation",
                  [(n, s, ([float("nan")] + v[1:]) if n == "layers.0.k" else v) for n, s, v in dump_tensors()],
                  "non-finite"),
    ]
    if args.k:
        cases = [c for c in cases if args.k in c.name or c.control]

    failures, rows = [], []
    for c in cases:
        c.make()
        rc, out, err, secs, rss = run(args.oscar, c.argv, c.env, args.timeout)
        lines = [l for l in err.strip().splitlines() if l.strip()]
        last = lines[-1] if lines else ""
        problems = []
        if rc is None:
            problems.append("timed out after %.0f s" % args.timeout)
        elif rc < 0:
            problems.append("killed by signal %d" % -rc)
        if rss > args.max_rss_mb:
            problems.append("max RSS %.0f MiB > %.0f" % (rss, args.max_rss_mb))
        for bad in ("terminate called", "Sanitizer", "runtime error:", "Segmentation", "Aborted"):
            if bad in err:
                problems.append("stderr has '%s'" % bad)
        if c.expect is None:  # a control
            if rc != 0:
                problems.append("control failed (rc %s): %s" % (rc, last))
        else:
            if rc != 1:
                problems.append("exit status %s (want 1)" % rc)
            if ": error: " not in last:
                problems.append("last stderr line is not an error message: %r" % last[:200])
            elif c.expect.lower() not in last.lower():
                problems.append("message lacks %r: %r" % (c.expect, last[:300]))
        status = "ok" if not problems else "FAIL"
        print("%-26s %-4s %5.1fs  %s" % (c.name, status, secs, "; ".join(problems) if problems else last[:160]),
              flush=True)
        if problems:
            failures.append(c.name)
        msg = last.split(": error: ", 1)[-1] if c.expect is not None else "(loads; exit 0)"
        rows.append((c.name, c.what, " ".join(c.argv[:1]), rc, msg.replace(work + "/", "")))
    if args.table:
        print("\n| case | file | command | exit | message |\n|---|---|---|---|---|")
        for name, what, cmd, rc, msg in rows:
            print("| %s | %s | `oscar %s` | %s | %s |" % (name, what, cmd, rc, msg.replace("|", "\\|")[:220]))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print("\n%d cases, %d failed%s" % (len(cases), len(failures), (": " + ", ".join(failures)) if failures else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
