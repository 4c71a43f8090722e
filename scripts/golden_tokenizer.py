#!/usr/bin/env python3
"""Golden token ids from reference tokenizers, for tests/model/test_tokenizer*.cpp.

Writes tests/data/model/tokenizer_golden.json:
  {"texts": [...], "ids": {"tiny-llama": [[...], ...], "tiny-qwen2": ..., "tiny-qwen3": ...,
                           "smollm2": [[...], ...]}, "reference": {...}}
ids[name][i] = ids of texts[i] with add_special_tokens=False (special tokens
written in the text are matched as tokens).

References:
  tiny-*   HF `tokenizers` on the committed tokenizer.json;
  smollm2  HF `tokenizers` on a tokenizer.json rebuilt from the GGUF metadata
           with SmolLM2's pre-tokenizer (Digits(individual) + ByteLevel), and,
           when llama-cpp-python is installed, llama.cpp's own tokenizer on the
           GGUF; the script fails if the two disagree.
The smollm2 part is skipped when models/ lacks the default model
(scripts/fetch_model.sh). Needs: pip install tokenizers gguf numpy [llama-cpp-python].
"""
import json
import os
import sys

from tokenizers import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "model")
GGUF = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space and trailing space ",
    "    four spaces, then\ttab\t\tand\n\nnewlines\r\n\r\nCRLF",
    "Numbers: 0 7 42 123 1234 12345 3.14159 1e-5 0x7fff 1,000,000 -273.15",
    "I'm sure you'd say they've done it, she's HERE and We'LL see; DON'T.",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n",
    "int main() { for (int i = 0; i < 10; ++i) printf(\"%d\\n\", i); }",
    "Ünïcödé: café naïve Straße ÆØÅ ½ ©®™ … “quotes” — dash",
    "CJK: 東京は日本の首都です。北京市 한국어 텍스트",
    "Cyrillic привет мир, Greek αβγ δ, Arabic مرحبا, Hebrew שלום, Hindi नमस्ते",
    "Emoji 🙂👍🏽 👨‍👩‍👧 🚀 and symbols ∑∫√∞ ≤≥ ⊕",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "a<|im_end|>b <|endoftext|>  <|im_start|>",
    "       \n\n\n\t\t   x    ",
    "URL https://example.com/path?q=1&r=two#frag and e-mail foo.bar@baz.org",
    "",
    "ALLCAPS lowercase MiXeD camelCaseWord snake_case_word kebab-case-word",
    "!!!??? ... --- *** ### @@@ $$$ %%% ^^^ &&& ((( ))) [[[ ]]] {{{ }}}",
    "1234567890" * 3,
]


def gguf_to_tokenizer_json(path):
    """A tokenizer.json equivalent to SmolLM2-135M-Instruct's, from GGUF metadata."""
    from gguf import GGUFReader
    r = GGUFReader(path)
    f = r.fields
    toks = [str(bytes(f["tokenizer.ggml.tokens"].parts[i]), "utf-8") for i in f["tokenizer.ggml.tokens"].data]
    types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
    merges = [str(bytes(f["tokenizer.ggml.merges"].parts[i]), "utf-8") for i in f["tokenizer.ggml.merges"].data]
    pre = str(bytes(f["tokenizer.ggml.pre"].parts[-1]), "utf-8")
    assert pre == "smollm", pre
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, (t, ty) in enumerate(zip(toks, types)) if ty in (3, 4)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(toks)}, "merges": merges},
    }


def main():
    out = {"texts": TEXTS, "ids": {}, "reference": {}}
    for name in ("tiny-llama", "tiny-qwen2", "tiny-qwen3"):
        tok = Tokenizer.from_file(os.path.join(DATA, name, "tokenizer.json"))
        out["ids"][name] = [tok.encode(t, add_special_tokens=False).ids for t in TEXTS]
        for t, ids in zip(TEXTS, out["ids"][name]):
            assert tok.decode(ids, skip_special_tokens=False) == t, (name, t)
        out["reference"][name] = "HF tokenizers on tokenizer.json"
    if os.path.exists(GGUF):
        tj = gguf_to_tokenizer_json(GGUF)
        tok = Tokenizer.from_str(json.dumps(tj))
        hf = [tok.encode(t, add_special_tokens=False).ids for t in TEXTS]
        ref = "HF tokenizers on a tokenizer.json rebuilt from the GGUF (Digits + ByteLevel)"
        try:
            from llama_cpp import Llama
            llm = Llama(model_path=GGUF, vocab_only=True, verbose=False)
            lc = [llm.tokenize(t.encode("utf-8"), add_bos=False, special=True) if t else [] for t in TEXTS]
            bad = [i for i, (a, b) in enumerate(zip(hf, lc)) if a != b]
            if bad:
                for i in bad:
                    print("DISAGREE", repr(TEXTS[i]), hf[i], lc[i])
                return 1
            ref += "; identical to llama.cpp's tokenizer (llama-cpp-python)"
        except ImportError:
            ref += "; llama-cpp-python not installed, not cross-checked"
        out["ids"]["smollm2"] = hf
        out["reference"]["smollm2"] = ref
    else:
        print("note: no", GGUF, "- smollm2 ids not written (run scripts/fetch_model.sh)")
    with open(os.path.join(DATA, "tokenizer_golden.json"), "w") as f:
        json.dump(out, f, ensure_ascii=False, indent=0)
    print("wrote", os.path.join(DATA, "tokenizer_golden.json"), {k: v for k, v in out["reference"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
