#!/usr/bin/env python3
"""Golden logits from Hugging Face transformers (the reference forward).

    python3 scripts/golden_logits.py --tiny --out DIR        # tests/data/model/tiny-*
    python3 scripts/golden_logits.py --default GGUF --out DIR  # SmolLM2 GGUF (transformers' GGUF loader)
    python3 scripts/golden_logits.py --qwen GGUF --out DIR     # Qwen2.5-Coder-1.5B-Instruct GGUF (CPU)

Runs in float64 (on CUDA when available), so the reference carries no fp32
accumulation noise; results are stored as float32. Meant for the GPU machine,
which has torch + transformers (the `gguf` package must be importable for
--default). --tiny/--default: model.double() (transformers still computes
RMSNorm, RoPE cos/sin and the attention softmax in float32 there). --qwen keeps
the dequantized weights in float32 (1.78 B parameters: 7.1 GB, 14.2 GB in
float64 would not fit the 24 GB CPU machine) and computes everything in float64:
each Linear upcasts its weight for the product (exact: the weights are fp32
values), and RMSNorm, RoPE and softmax are patched to float64 (--qwen-dtype
float32 runs plain float32 instead). Output format (safetensors, one file per
model, see docs/models.md):

  input_ids      I64 [T]        prompt ids (BOS included where the tokenizer adds one)
  logits         F32 [T, V]     (tiny models) next-token logits at every prompt position
  last_logits    F32 [V]        logits at the last prompt position
  topk_ids       I64 [T, K]     (SmolLM2, Qwen) top-K ids per prompt position, K = 16
  topk_logits    F32 [T, K]     their logits
  greedy_ids     I64 [G]        greedy continuation (argmax, no stop tokens), G = 40
  greedy_margin  F32 [G]        top-1 minus top-2 logit at each greedy step (near 0 = tie risk)
  __metadata__   prompt, model, versions, dtype
"""
import argparse
import importlib.metadata
import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DATA = os.path.join(ROOT, "tests", "data", "model")
sys.path.insert(0, HERE)

TINY_PROMPT = "The quick brown fox jumps over the lazy dog. 12345 <|im_end|> def f(x): return x ** 2"
DEFAULT_PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                  "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
QWEN_PROMPT = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
               "<|im_start|>user\nWrite a Python function `is_prime(n)` that returns True if n is a prime number "
               "and False otherwise. Keep it short.<|im_end|>\n<|im_start|>assistant\n")
GREEDY = 40
TOPK = 16


def run(model, ids, dev):
    x = torch.tensor([ids], dtype=torch.long, device=dev)
    with torch.no_grad():
        logits = model(x).logits[0].double()
        greedy, margin = [], []
        cur = x
        for _ in range(GREEDY):
            last = model(cur).logits[0, -1].double()
            top2 = torch.topk(last, 2)
            greedy.append(int(top2.indices[0]))
            margin.append(float(top2.values[0] - top2.values[1]))
            cur = torch.cat([cur, top2.indices[:1].view(1, 1)], dim=1)
    return logits.float().cpu(), greedy, margin


def meta(extra):
    m = {"transformers": transformers.__version__, "torch": torch.__version__, "compute_dtype": "float64"}
    m.update(extra)
    return {k: str(v) for k, v in m.items()}


def tiny(out, dev):
    from tokenizers import Tokenizer
    for name in ("tiny-llama", "tiny-qwen2", "tiny-qwen3"):
        d = os.path.join(DATA, name)
        tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        ids = tok.encode(TINY_PROMPT, add_special_tokens=True).ids
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        model = model.to(dev).double().eval()
        logits, greedy, margin = run(model, ids, dev)
        t = {"input_ids": torch.tensor(ids, dtype=torch.int64), "logits": logits.contiguous(),
             "last_logits": logits[-1].clone().contiguous(), "greedy_ids": torch.tensor(greedy, dtype=torch.int64),
             "greedy_margin": torch.tensor(margin, dtype=torch.float32)}
        save_file(t, os.path.join(out, f"{name}-golden.safetensors"),
                  metadata=meta({"model": name, "prompt": TINY_PROMPT}))
        print(name, "T", len(ids), "greedy", greedy[:12], "min margin", min(margin))


def default(gguf_path, out, dev):
    import golden_tokenizer
    from tokenizers import Tokenizer
    tok = Tokenizer.from_str(json.dumps(golden_tokenizer.gguf_to_tokenizer_json(gguf_path)))
    ids = tok.encode(DEFAULT_PROMPT, add_special_tokens=False).ids
    d, f = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32, attn_implementation="eager")
    model = model.to(dev).double().eval()
    logits, greedy, margin = run(model, ids, dev)
    top = torch.topk(logits, TOPK, dim=-1)
    t = {"input_ids": torch.tensor(ids, dtype=torch.int64), "last_logits": logits[-1].clone().contiguous(),
         "topk_ids": top.indices.to(torch.int64).contiguous(), "topk_logits": top.values.contiguous(),
         "greedy_ids": torch.tensor(greedy, dtype=torch.int64),
         "greedy_margin": torch.tensor(margin, dtype=torch.float32)}
    save_file(t, os.path.join(out, "smollm2-golden.safetensors"),
              metadata=meta({"model": "SmolLM2-135M-Instruct.Q4_1.gguf (dequantized by transformers/gguf-py)",
                             "prompt": DEFAULT_PROMPT}))
    print("smollm2 T", len(ids), "greedy text:", repr(tok.decode(greedy, skip_special_tokens=False)),
          "min margin", min(margin))


def float64_compute(model):
    """Computes in float64 while the weights stay float32 (see the module doc)."""
    import types
    import torch.nn.functional as F
    from transformers.models.qwen2 import modeling_qwen2 as mq

    def linear(self, x):
        return F.linear(x, self.weight.double(), None if self.bias is None else self.bias.double())

    def embedding(self, ids):
        return F.embedding(ids, self.weight).double()

    def rms_norm(self, x):
        x = x.double()
        return self.weight.double() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    rot = model.model.rotary_emb
    theta = float(model.config.rope_parameters["rope_theta"])
    d = model.config.hidden_size // model.config.num_attention_heads
    inv64 = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))

    def rope(self, x, position_ids):
        freqs = position_ids[..., None].double() * inv64.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        k = mq.repeat_kv(key, module.num_key_value_groups)
        v = mq.repeat_kv(value, module.num_key_value_groups)
        w = torch.matmul(query, k.transpose(2, 3)) * scaling
        if attention_mask is not None:
            w = w + attention_mask
        w = torch.softmax(w, dim=-1)  # float64 (transformers': float32)
        return torch.matmul(w, v).transpose(1, 2).contiguous(), w

    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.forward = types.MethodType(linear, mod)
        elif isinstance(mod, torch.nn.Embedding):
            mod.forward = types.MethodType(embedding, mod)
        elif isinstance(mod, mq.Qwen2RMSNorm):
            mod.forward = types.MethodType(rms_norm, mod)
    rot.forward = types.MethodType(rope, rot)
    mq.eager_attention_forward = eager


def peak_rss_gib():
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def qwen(gguf_path, out, dev, dtype):
    """Qwen2.5-Coder-1.5B-Instruct: prompt forward (top-K per position, last
    logits) and greedy continuation through transformers' KV cache."""
    import time
    import golden_tokenizer
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    tok = Tokenizer.from_str(json.dumps(golden_tokenizer.gguf_to_tokenizer_json(gguf_path)))
    ids = tok.encode(QWEN_PROMPT, add_special_tokens=False).ids
    d, f = os.path.split(os.path.abspath(gguf_path))
    tf_ids = AutoTokenizer.from_pretrained(d, gguf_file=f).encode(QWEN_PROMPT, add_special_tokens=False)
    assert tf_ids == ids, ("transformers' GGUF tokenizer disagrees on the prompt", tf_ids, ids)
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32, attn_implementation="eager")
    model = model.to(dev).eval()
    c = model.config
    print(f"loaded in {time.time() - t0:.0f} s, peak RSS {peak_rss_gib():.2f} GiB; layers {c.num_hidden_layers} "
          f"heads {c.num_attention_heads}/{c.num_key_value_heads} vocab {c.vocab_size} theta "
          f"{c.rope_parameters['rope_theta']} eps {c.rms_norm_eps} tied {c.tie_word_embeddings} "
          f"sliding {getattr(c, 'use_sliding_window', None)}", flush=True)
    assert not c.tie_word_embeddings and c.num_hidden_layers == 28 and c.vocab_size == 151936
    if dtype == "float64":
        float64_compute(model)
    t0 = time.time()
    with torch.no_grad():
        o = model(torch.tensor([ids], device=dev), use_cache=True)
        logits = o.logits[0].double()
        assert logits.dtype == torch.float64 and (dtype == "float64") == (o.logits.dtype == torch.float64)
        print(f"prompt forward (T={len(ids)}) {time.time() - t0:.0f} s", flush=True)
        cache, last = o.past_key_values, logits[-1]
        greedy, margin = [], []
        for i in range(GREEDY):
            top2 = torch.topk(last, 2)
            greedy.append(int(top2.indices[0]))
            margin.append(float(top2.values[0] - top2.values[1]))
            if i + 1 < GREEDY:
                o = model(top2.indices[:1].view(1, 1), past_key_values=cache, use_cache=True)
                cache, last = o.past_key_values, o.logits[0, -1].double()
        # The cached greedy steps against one cache-free forward over the prompt
        # and the greedy tokens (teacher forcing): same argmax and margins.
        full = model(torch.tensor([ids + greedy[:-1]], device=dev), use_cache=False).logits[0, len(ids) - 1:].double()
        top2 = torch.topk(full, 2, dim=-1)
        dm = max(abs(float(top2.values[i, 0] - top2.values[i, 1]) - margin[i]) for i in range(GREEDY))
        assert top2.indices[:, 0].tolist() == greedy, "cached and cache-free greedy disagree"
        assert torch.allclose(full[0], logits[-1], rtol=0, atol=1e-9 if dtype == "float64" else 1e-3)
        print(f"cache-free check: same greedy ids, margins differ by at most {dm:.2g}", flush=True)
    top = torch.topk(logits, TOPK, dim=-1)
    t = {"input_ids": torch.tensor(ids, dtype=torch.int64), "last_logits": logits[-1].float().contiguous(),
         "topk_ids": top.indices.to(torch.int64).contiguous(), "topk_logits": top.values.float().contiguous(),
         "greedy_ids": torch.tensor(greedy, dtype=torch.int64),
         "greedy_margin": torch.tensor(margin, dtype=torch.float32)}
    rss = peak_rss_gib()
    m = meta({"model": "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf (dequantized to float32 by transformers/gguf-py)",
              "prompt": QWEN_PROMPT, "compute_dtype": dtype, "device": dev,
              "weights": "float32 (dequantized GGUF values; " + (
                  "upcast to float64 per product; RMSNorm, RoPE, softmax in float64)" if dtype == "float64"
                  else "plain float32 forward)"),
              "greedy": "transformers KV cache (float64 K/V)" if dtype == "float64" else "transformers KV cache",
              "gguf": importlib.metadata.version("gguf"),
              "peak_rss_gib": f"{rss:.2f}"})
    path = os.path.join(out, "qwen2.5-coder-golden.safetensors")
    save_file(t, path, metadata=m)
    print(f"qwen2.5-coder T {len(ids)}, {time.time() - t0:.0f} s, peak RSS {rss:.2f} GiB; greedy text:",
          repr(tok.decode(greedy, skip_special_tokens=False)))
    print("margins", [round(x, 4) for x in margin], "min", min(margin), "at", margin.index(min(margin)))
    print("wrote", path, os.path.getsize(path), "bytes")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--default", metavar="GGUF")
    ap.add_argument("--qwen", metavar="GGUF")
    ap.add_argument("--qwen-dtype", choices=["float64", "float32"], default="float64")
    ap.add_argument("--out", default=DATA)
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(a.out, exist_ok=True)
    if a.tiny:
        tiny(a.out, dev)
    if a.default:
        default(a.default, a.out, dev)
    if a.qwen:
        qwen(a.qwen, a.out, dev, a.qwen_dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
