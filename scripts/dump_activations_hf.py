#!/usr/bin/env python3
"""Dumps post-RoPE Q/K/V and the attention output O of every layer of a
Hugging Face `transformers` causal LM into the activation-dump format of
DESIGN §9, so that `oscar calibrate --activations DUMP` serves models run in
any framework:

    layers.{i}.q  [T, H_q, d]   after q_norm (Qwen3) and RoPE
    layers.{i}.k  [T, H_kv, d]  after k_norm (Qwen3) and RoPE
    layers.{i}.v  [T, H_kv, d]
    layers.{i}.o  [T, H_q, d]   attention output per query head, before o_proj

The text is tokenized with the model's tokenizer and cut into chunks of
--chunk tokens, each run from position 0 (as `oscar calibrate -m` does).

    python3 scripts/dump_activations_hf.py MODEL_DIR --text data/calib.txt \\
        --tokens 16384 --chunk 2048 -o dump.safetensors
    oscar calibrate --activations dump.safetensors -o calib.safetensors --weights-hash HASH

Needs torch, transformers, safetensors.
"""
import argparse
import hashlib
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="Hugging Face model directory or hub id")
    ap.add_argument("--text", required=True, help="calibration text file")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--dtype", default="f32", choices=["f32", "f16", "bf16"], help="dump dtype")
    ap.add_argument("--device", default=None, help="cuda / cpu (default: cuda when available)")
    ap.add_argument("--no-o", action="store_true", help="omit the attention outputs")
    ap.add_argument("--weights-hash", default="", help="model.weights_hash metadata (oscar's fingerprint)")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # rotate-half

    dev = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 statistics, as our CPU route
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32,
                                                 attn_implementation="eager").to(dev).eval()
    cfg = model.config
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // Hq
    text = open(a.text, encoding="utf-8", errors="replace").read()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if len(ids) < a.tokens:
        sys.exit(f"{a.text}: {len(ids)} tokens, {a.tokens} requested")
    ids = ids[: a.tokens]

    layers = model.model.layers
    cap = {}
    hooks = []
    for i, layer in enumerate(layers):
        at = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            hooks.append(getattr(at, name).register_forward_hook(
                lambda m, inp, out, i=i, n=name[0]: cap.__setitem__((i, n), out.detach())))
        hooks.append(at.o_proj.register_forward_pre_hook(
            lambda m, inp, i=i: cap.__setitem__((i, "o"), inp[0].detach())))

    out = {f"layers.{i}.{w}": [] for i in range(len(layers)) for w in "qkvo"}
    with torch.no_grad():
        for t0 in range(0, a.tokens, a.chunk):
            x = torch.tensor([ids[t0:t0 + a.chunk]], device=dev)
            T = x.shape[1]
            model(x, use_cache=False)
            pos = torch.arange(T, device=dev)[None]
            for i, layer in enumerate(layers):
                at = layer.self_attn
                q = cap[(i, "q")].view(1, T, Hq, d)
                k = cap[(i, "k")].view(1, T, Hkv, d)
                v = cap[(i, "v")].view(1, T, Hkv, d)
                if hasattr(at, "q_norm"):  # Qwen3: RMSNorm over head_dim before RoPE
                    q, k = at.q_norm(q), at.k_norm(k)
                cos, sin = model.model.rotary_emb(v, pos)
                q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
                out[f"layers.{i}.q"].append(q.transpose(1, 2)[0].float().cpu())
                out[f"layers.{i}.k"].append(k.transpose(1, 2)[0].float().cpu())
                out[f"layers.{i}.v"].append(v[0].float().cpu())
                out[f"layers.{i}.o"].append(cap[(i, "o")].view(T, Hq, d).float().cpu())
            print(f"\rdump: {min(t0 + a.chunk, a.tokens)}/{a.tokens} tokens", end="", file=sys.stderr)
    print(file=sys.stderr)
    for h in hooks:
        h.remove()
    dt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
    tensors = {k: torch.cat(v).to(dt).contiguous() for k, v in out.items() if v and not (a.no_o and k.endswith(".o"))}
    meta = {"model.architecture": cfg.model_type,
            "calib.text_hash": hashlib.sha256(str(ids).encode()).hexdigest()[:16],
            "calib.source": f"{a.model} + {a.text} (dump_activations_hf.py)"}
    if a.weights_hash:
        meta["model.weights_hash"] = a.weights_hash
    save_file(tensors, a.output, metadata=meta)
    print(f"wrote {a.output}: {len(layers)} layers, {a.tokens} tokens, Hq {Hq}, Hkv {Hkv}, d {d}")


if __name__ == "__main__":
    main()
