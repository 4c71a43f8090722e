#!/usr/bin/env python3
"""CPU-only cross-check of the default model's golden logits: an independent
float64 numpy Llama forward over the GGUF dequantized by gguf-py, with Q/K rows
un-permuted to the rotate-half convention (the same un-permutation the C++
loader does). It must match tests/data/model/smollm2-golden.safetensors (made
by transformers on the GPU machine) to ~1e-6 relative.

    pip install numpy gguf safetensors; bash scripts/fetch_model.sh
    python3 scripts/golden_numpy_check.py
"""
import os
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.chdir(ROOT)
r = GGUFReader('models/SmolLM2-135M-Instruct.Q4_1.gguf')
W = {}
for t in r.tensors:
    a = dequantize(t.data, t.tensor_type).astype(np.float64)
    W[t.name] = a.reshape([int(x) for x in reversed(t.shape)]) if a.ndim>1 or len(t.shape)>1 else a
H, nh, nkv, hd, L = 576, 9, 3, 64, 30
def unperm(w, n):
    rows, cols = w.shape
    return w.reshape(n, hd//2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
g = load_file('tests/data/model/smollm2-golden.safetensors')
ids = g['input_ids']
T = len(ids)
def rms(x, w): return x / np.sqrt((x*x).mean(-1, keepdims=True) + 1e-5) * w
inv = 1.0 / (100000.0 ** (np.arange(0, hd, 2) / hd))
ang = np.arange(T)[:, None] * inv[None, :]
cos, sin = np.cos(ang), np.sin(ang)
def rope(x):  # [T, n, hd]
    a, b = x[..., :hd//2], x[..., hd//2:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([a*c - b*s, b*c + a*s], -1)
E = W['token_embd.weight']
x = E[ids]
mask = np.triu(np.full((T, T), -np.inf), 1)
for l in range(L):
    p = f'blk.{l}.'
    h = rms(x, W[p+'attn_norm.weight'])
    q = (h @ unperm(W[p+'attn_q.weight'], nh).T).reshape(T, nh, hd)
    k = (h @ unperm(W[p+'attn_k.weight'], nkv).T).reshape(T, nkv, hd)
    v = (h @ W[p+'attn_v.weight'].T).reshape(T, nkv, hd)
    q, k = rope(q), rope(k)
    o = np.zeros((T, nh, hd))
    for i in range(nh):
        j = i // (nh // nkv)
        s = q[:, i] @ k[:, j].T / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True)); s /= s.sum(-1, keepdims=True)
        o[:, i] = s @ v[:, j]
    x = x + o.reshape(T, -1) @ W[p+'attn_output.weight'].T
    h = rms(x, W[p+'ffn_norm.weight'])
    gt = h @ W[p+'ffn_gate.weight'].T
    x = x + ((gt / (1 + np.exp(-gt))) * (h @ W[p+'ffn_up.weight'].T)) @ W[p+'ffn_down.weight'].T
x = rms(x, W['output_norm.weight'])
logits = x @ E.T
ref = g['last_logits']
print('numpy fp64 vs transformers last logits: max|diff|', np.abs(logits[-1]-ref).max(), 'rel', np.linalg.norm(logits[-1]-ref)/np.linalg.norm(ref))
print('top1 agree', (logits.argmax(-1) == g['topk_ids'][:,0]).mean())
sys.exit(0 if np.abs(logits[-1]-ref).max() < 1e-3 else 1)
