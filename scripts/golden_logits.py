#!/usr/bin/env python3
"""Golden logits from Hugging Face transformers (the reference forward).

    python3 scripts/golden_logits.py --tiny --out DIR        # tests/data/model/tiny-*
    python3 scripts/golden_logits.py --default GGUF --out DIR  # SmolLM2 GGUF (transformers' GGUF loader)

Runs in float64 (on CUDA when available), so the reference carries no fp32
accumulation noise; results are stored as float32. Meant for the GPU machine,
which has torch + transformers (the `gguf` package must be importable for
--default). Output format (safetensors, one file per model, see docs/models.md):

  input_ids      I64 [T]        prompt ids (BOS included where the tokenizer adds one)
  logits         F32 [T, V]     (tiny models) next-token logits at every prompt position
  last_logits    F32 [V]        logits at the last prompt position
  topk_ids       I64 [T, K]     (default model) top-K ids per prompt position, K = 16
  topk_logits    F32 [T, K]     their logits
  greedy_ids     I64 [G]        greedy continuation (argmax, no stop tokens), G = 40
  greedy_margin  F32 [G]        top-1 minus top-2 logit at each greedy step (near 0 = tie risk)
  __metadata__   prompt, model, versions, dtype
"""
import argparse
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--default", metavar="GGUF")
    ap.add_argument("--out", default=DATA)
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(a.out, exist_ok=True)
    if a.tiny:
        tiny(a.out, dev)
    if a.default:
        default(a.default, a.out, dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
