#!/usr/bin/env python3
"""Compares llama.cpp (llama-cpp-python, CPU) with the transformers golden file
for the default model on the same prompt ids: how close two references are.

    python3 scripts/golden_llamacpp.py    # needs models/ (scripts/fetch_model.sh)

Prints the max |diff| of the last-position logits, top-1 agreement over the
prompt positions and the greedy continuation agreement. llama.cpp multiplies
Q4_1 weights with activations quantized to Q8_1, so it is not bit-comparable to
a dequantize-to-fp32 forward; transformers' file stays the golden reference.
"""
import os
import sys

import numpy as np
from llama_cpp import Llama
from safetensors.numpy import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GGUF = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
GOLD = os.path.join(ROOT, "tests", "data", "model", "smollm2-golden.safetensors")


def main():
    g = load_file(GOLD)
    ids = g["input_ids"].tolist()
    llm = Llama(model_path=GGUF, n_ctx=256, logits_all=True, verbose=False, n_threads=2, seed=0)
    llm.eval(ids)
    logits = np.array(llm.scores[:len(ids)], dtype=np.float32)
    last = logits[-1]
    ref_last = g["last_logits"]
    top1 = logits.argmax(-1)
    agree = float((top1 == g["topk_ids"][:, 0]).mean())
    # greedy continuation
    out = []
    for _ in range(len(g["greedy_ids"])):
        nxt = int(np.array(llm.scores[llm.n_tokens - 1]).argmax())
        out.append(nxt)
        llm.eval([nxt])
    gref = g["greedy_ids"].tolist()
    n_same = next((i for i, (a, b) in enumerate(zip(out, gref)) if a != b), len(gref))
    print(f"last-position logits: max|diff| {np.abs(last - ref_last).max():.4f}, "
          f"rel L2 {np.linalg.norm(last - ref_last) / np.linalg.norm(ref_last):.5f}")
    print(f"top-1 agreement over {len(ids)} prompt positions: {agree:.3f}")
    print(f"greedy continuation: first {n_same} of {len(gref)} tokens identical")
    print("llama.cpp greedy:", llm.detokenize(out).decode("utf-8", "replace")[:200].replace("\n", "\\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
