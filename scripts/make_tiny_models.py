#!/usr/bin/env python3
"""Creates the tiny random-weight test models in tests/data/model/ (HF format).

    tiny-llama/  LlamaForCausalLM, GQA 2/1, head_dim 64, llama3 rope scaling,
                 untied LM head, F32 weights, two safetensors shards + index
    tiny-qwen2/  Qwen2ForCausalLM, GQA 2/1, QKV bias, tied embeddings, BF16 weights
    tiny-qwen3/  Qwen3ForCausalLM, GQA 4/2, QK-norm, head_dim 64 != hidden/heads, F16

All use head_dim 64, the smallest head size the attention kernels take
(DESIGN §2: 64, 128, 256); hidden 128, 2 layers, vocab 512.

Each gets config.json, model*.safetensors, tokenizer.json (a 512-token
byte-level BPE trained here with HF `tokenizers`, the family's pre-tokenizer
regex) and tokenizer_config.json. Needs: numpy, safetensors, tokenizers
(pip install numpy safetensors tokenizers). Deterministic (fixed seeds).

Golden logits come from scripts/golden_logits.py (transformers, GPU machine).
"""
import json
import os
import sys

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "model")

LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's 2024 and we're testing 123 tokenizers!",
    "def main(argv):\n    for i in range(10):\n        print(f'{i:>4} -> {i * i}')\n    return 0\n",
    "Attention is all you need; keys, values, queries: q·k/√d. Rotations R = U·H·P.",
    "Ünïcödé text: café, naïve, Straße, 東京, 北京市, こんにちは, привет мир, مرحبا, 🙂👍.",
    "Numbers: 3.14159, 2,718, 1e-5, 0x7fff, 65536, -42, 1000000.",
    "    Indented    with   runs of    spaces\tand\ttabs\n\n\nand newlines.\r\n",
    "int main() { std::vector<int> v{1, 2, 3}; return v.size() > 2 ? 0 : 1; }",
    "Hello world! Hello World! HELLO WORLD! hello, world? I'll, you'd, they've, she's.",
] * 20


def train_tokenizer(regex, bos):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + ([bos] if bos else [])
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def rand(rng, shape, scale):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def make(name, arch, cfg, dtype, tie, bias, qk_norm, regex, bos, shards, seed):
    rng = np.random.default_rng(seed)
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    tok = train_tokenizer(regex, bos)
    vocab = tok.get_vocab_size()
    assert vocab <= cfg["vocab_size"], vocab
    tok.save(os.path.join(d, "tokenizer.json"))
    H, L, I = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    V = cfg["vocab_size"]
    # Tied heads read the embedding back: a unit-scale embedding makes every
    # token predict itself, so keep it small there to get varied greedy text.
    t = {"model.embed_tokens.weight": rand(rng, (V, H), 0.1 if tie else 1.0),
         "model.norm.weight": (1.0 + rand(rng, (H,), 0.1))}
    for i in range(L):
        p = f"model.layers.{i}."
        s = 1.0 / np.sqrt(H)
        t[p + "input_layernorm.weight"] = 1.0 + rand(rng, (H,), 0.1)
        t[p + "post_attention_layernorm.weight"] = 1.0 + rand(rng, (H,), 0.1)
        t[p + "self_attn.q_proj.weight"] = rand(rng, (nh * hd, H), s)
        t[p + "self_attn.k_proj.weight"] = rand(rng, (nkv * hd, H), s)
        t[p + "self_attn.v_proj.weight"] = rand(rng, (nkv * hd, H), s)
        t[p + "self_attn.o_proj.weight"] = rand(rng, (H, nh * hd), 1.0 / np.sqrt(nh * hd))
        if bias:
            t[p + "self_attn.q_proj.bias"] = rand(rng, (nh * hd,), 0.1)
            t[p + "self_attn.k_proj.bias"] = rand(rng, (nkv * hd,), 0.1)
            t[p + "self_attn.v_proj.bias"] = rand(rng, (nkv * hd,), 0.1)
        if qk_norm:
            t[p + "self_attn.q_norm.weight"] = 1.0 + rand(rng, (hd,), 0.1)
            t[p + "self_attn.k_norm.weight"] = 1.0 + rand(rng, (hd,), 0.1)
        t[p + "mlp.gate_proj.weight"] = rand(rng, (I, H), s)
        t[p + "mlp.up_proj.weight"] = rand(rng, (I, H), s)
        t[p + "mlp.down_proj.weight"] = rand(rng, (H, I), 1.0 / np.sqrt(I))
    if not tie:
        t["lm_head.weight"] = rand(rng, (V, H), 1.0 / np.sqrt(H))
    if dtype == "float16":
        t = {k: v.astype(np.float16) for k, v in t.items()}
    elif dtype == "bfloat16":
        # numpy has no bf16: keep the top 16 bits (round to nearest even) and
        # write the raw bits through safetensors' bf16 dtype via ml_dtypes-free path.
        t = {k: to_bf16(v) for k, v in t.items()}
    for f in os.listdir(d):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(os.path.join(d, f))
    names = sorted(t)
    if shards == 1:
        save(t, os.path.join(d, "model.safetensors"))
    else:
        weight_map = {}
        per = (len(names) + shards - 1) // shards
        for s in range(shards):
            fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: t[k] for k in names[s * per:(s + 1) * per]}
            save(part, os.path.join(d, fn))
            weight_map.update({k: fn for k in part})
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f, indent=1)
    full = dict(cfg)
    full.update({"architectures": [arch], "model_type": arch.replace("ForCausalLM", "").lower(),
                 "tie_word_embeddings": tie, "torch_dtype": dtype, "hidden_act": "silu",
                 "attention_bias": bias, "use_cache": True})
    if bos:
        full["bos_token_id"] = tok.token_to_id(bos)
    full["eos_token_id"] = tok.token_to_id("<|im_end|>")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(full, f, indent=1)
    tc = {"eos_token": "<|im_end|>", "bos_token": bos, "add_bos_token": bool(bos),
          "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                           "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
          "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg["max_position_embeddings"]}
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=1)
    print(name, "params", sum(v.size for v in t.values()), "vocab", vocab)


def to_bf16(x):
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def save(t, path):
    # safetensors.numpy cannot tag uint16 arrays as BF16: write the file by hand
    # for bf16 (same format: 8-byte header length, JSON header, raw data).
    if not any(v.dtype == np.uint16 for v in t.values()):
        save_file(t, path, metadata={"format": "pt"})
        return
    header, off, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for k in sorted(t):
        b = np.ascontiguousarray(t[k]).tobytes()
        header[k] = {"dtype": "BF16", "shape": list(t[k].shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little"))
        f.write(h)
        for b in blobs:
            f.write(b)


def main():
    base = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 256, "rope_theta": 10000.0}
    llama = dict(base, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                 rms_norm_eps=1e-5, rope_theta=500000.0 / 50, mlp_bias=False)
    make("tiny-llama", "LlamaForCausalLM", llama, "float32", tie=False, bias=False, qk_norm=False,
         regex=LLAMA3_RE, bos="<|begin_of_text|>", shards=2, seed=1)
    qwen2 = dict(base, rope_theta=1000000.0, sliding_window=None, use_sliding_window=False)
    make("tiny-qwen2", "Qwen2ForCausalLM", qwen2, "bfloat16", tie=True, bias=True, qk_norm=False,
         regex=QWEN2_RE, bos=None, shards=1, seed=2)
    qwen3 = dict(base, num_attention_heads=4, num_key_value_heads=2, head_dim=64, rope_theta=1000000.0, sliding_window=None, use_sliding_window=False)
    make("tiny-qwen3", "Qwen3ForCausalLM", qwen3, "float16", tie=False, bias=False, qk_norm=True,
         regex=QWEN2_RE, bos=None, shards=1, seed=3)
    return 0


if __name__ == "__main__":
    sys.exit(main())
