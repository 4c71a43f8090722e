#!/usr/bin/env python3
"""llama.cpp (through PyPI's llama-cpp-python) on the same GGUF and the same
token pattern as bench/bench_engine.cpp, for the ratio that benchmark prints.

    python3 scripts/bench_llamacpp.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --prompt 256 --gen 64 --threads 2 --reps 3

Last line: "prefill_tok_s=X decode_tok_s=Y" (best of --reps). Install with
`pip install llama-cpp-python` (builds llama.cpp from source, CPU backend).
"""
import argparse
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    try:
        from llama_cpp import Llama
    except ImportError as e:
        print(f"llama-cpp-python not installed ({e})")
        return 1
    llm = Llama(model_path=a.model, n_ctx=a.prompt + a.gen + 16, n_batch=512, n_ubatch=512,
                n_threads=a.threads, n_threads_batch=a.threads, verbose=False)
    vocab = llm.n_vocab()
    prompt = [(i * 7919 + 13) % vocab for i in range(a.prompt)]
    best_p, best_d = 1e30, 1e30
    for _ in range(a.reps):
        llm.reset()
        llm._ctx.memory_clear(True) if hasattr(llm._ctx, "memory_clear") else None
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        tok = 1
        for _ in range(a.gen):
            llm.eval([tok])
            tok = int(llm.scores[llm.n_tokens - 1].argmax())
        t2 = time.perf_counter()
        best_p = min(best_p, t1 - t0)
        best_d = min(best_d, (t2 - t1) / a.gen)
    print(f"prefill_tok_s={a.prompt / best_p:.2f} decode_tok_s={1.0 / best_d:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
