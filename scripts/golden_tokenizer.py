#!/usr/bin/env python3
"""Golden token ids from reference tokenizers, for tests/model/test_tokenizer*.cpp.

Writes tests/data/model/tokenizer_golden.json:
  {"texts": [...], "ids": {"tiny-llama": [[...], ...], "tiny-qwen2": ..., "tiny-qwen3": ...,
                           "smollm2": [[...], ...], "qwen2.5-coder": [[...], ...]},
   "extra_texts": {"qwen2.5-coder": [...]}, "extra_ids": {"qwen2.5-coder": [[...], ...]},
   "reference": {...}}
ids[name][i] = ids of texts[i] with add_special_tokens=False (special tokens
written in the text are matched as tokens); extra_texts/extra_ids: more texts
for one model only (Qwen2.5-Coder: FIM/tool/repo special tokens, code, digits
of other scripts, Unicode spaces, ...).

References:
  tiny-*   HF `tokenizers` on the committed tokenizer.json;
  smollm2  HF `tokenizers` on a tokenizer.json rebuilt from the GGUF metadata
           with SmolLM2's pre-tokenizer (Digits(individual) + ByteLevel), and,
           when llama-cpp-python is installed, llama.cpp's own tokenizer on the
           GGUF; the script fails if the two disagree.
  qwen2.5-coder  the same on a tokenizer.json rebuilt from the Qwen GGUF with
           Qwen2's pre-tokenizer (NFC + Split(Qwen2 regex) + ByteLevel, as
           transformers' Qwen2Converter), and it must also equal transformers'
           own GGUF tokenizer conversion (AutoTokenizer gguf_file=, when
           transformers is installed) and llama.cpp's (when llama-cpp-python is).
The smollm2 / qwen2.5-coder parts are skipped when models/ lacks the GGUF
(scripts/fetch_model.sh, scripts/fetch_qwen.sh); their entries in the existing
file are then kept. `--only NAME` regenerates one entry and keeps the others.
Needs: pip install tokenizers gguf numpy [transformers torch] [llama-cpp-python].
"""
import json
import os
import sys

from tokenizers import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "model")
GGUF = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
QWEN_GGUF = os.path.join(ROOT, "models", "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

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

# More texts for Qwen2.5-Coder only: its added tokens (FIM, tool call, repo/file
# markers), code with tabs and deep indentation, digits of other scripts (\p{N}
# is one pre-token per digit in Qwen2), Unicode spaces, case-insensitive
# contractions, strings that look like special tokens but are not. All NFC
# (Qwen2 declares an NFC normalizer; llama.cpp and we do not apply it).
QWEN_TEXTS = [
    "<|fim_prefix|>def add(a, b):\n    <|fim_suffix|>\n    return c<|fim_middle|>c = a + b",
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
    "<|repo_name|>oscar<|file_sep|>src/main.cpp\n#include <cstdio>\nint main() { return 0; }\n",
    "class A:\n\tdef f(self, xs):\n\t\tif xs:\n\t\t\treturn [i for i in range(10) if i % 2 == 0]\n\t\treturn None\n",
    "        if (x != nullptr && *x >= 0x1F) {\n            y <<= 3; z->w[i++] = ~0u;\n        }\n",
    "3.141592653589793 2**64 = 18446744073709551616; 0b1010_1010 1_000_000 ١٢٣ ４５６ ⅫⅣ ²³",
    "a  b   c    d\n \n  \n\t \r\n x\u00a0y\u2003z\u3000w  \u2028end",
    "用Python写一个快速排序算法，要求时间复杂度为O(n log n)。日本語のコードコメント：// 変数",
    "✅ Done! 🎉🎉 🤖→🧠 🇫🇷🇯🇵 👩🏽‍💻 ❤️ 1️⃣",
    "IT'S DON'T I'M We've they'LL you'D She'S o'clock rock'n'roll",
    "line1\n\n\n\nline2\r\r\n  \n\t\nend\n",
    "<|im_start|>assistant<|im_end|><|endoftext|><|im_start|x <|im_end <|IM_START|> < |im_end|>",
    "<|im_start|>system\nYou are Qwen.<|im_end|>\n<|im_start|>user\n写代码<|im_end|>\n<|im_start|>assistant\n```python\nprint('hi')\n```<|im_end|>",
    "SELECT id, name FROM users WHERE age > 18 ORDER BY name DESC LIMIT 10;",
    "'''docstring''' \"\"\"triple\"\"\" `backticks` $HOME ${VAR:-x} @decorator #!/bin/bash",
    "[PAD151665] <|box_start|>(1,2)<|box_end|> <|vision_pad|>",
]

NAME_SMOLLM2 = "smollm2"
NAME_QWEN = "qwen2.5-coder"


def gguf_to_tokenizer_json(path):
    """A tokenizer.json equivalent to the GGUF's (SmolLM2-135M-Instruct or
    Qwen2.5-Coder-1.5B-Instruct), from its metadata."""
    from gguf import GGUFReader
    r = GGUFReader(path)
    f = r.fields
    toks = [str(bytes(f["tokenizer.ggml.tokens"].parts[i]), "utf-8") for i in f["tokenizer.ggml.tokens"].data]
    types = [int(f["tokenizer.ggml.token_type"].parts[i][0]) for i in f["tokenizer.ggml.token_type"].data]
    merges = [str(bytes(f["tokenizer.ggml.merges"].parts[i]), "utf-8") for i in f["tokenizer.ggml.merges"].data]
    pre = str(bytes(f["tokenizer.ggml.pre"].parts[-1]), "utf-8")
    assert pre in ("smollm", "qwen2"), pre
    # GGUF token types: 3 control, 4 user-defined (both matched in text first), 5 unused.
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": ty == 3 or pre == "smollm"}
             for i, (t, ty) in enumerate(zip(toks, types)) if ty in (3, 4)]
    if pre == "smollm":
        normalizer = None
        pre_tok = {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    else:  # Qwen2's tokenizer.json (transformers' Qwen2Converter)
        normalizer = {"type": "NFC"}
        pre_tok = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": normalizer,
        "pre_tokenizer": pre_tok,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(toks)}, "merges": merges},
    }


def llama_cpp_ids(path, texts):
    """llama.cpp's own tokenizer on the GGUF, or None without llama-cpp-python."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=path, vocab_only=True, verbose=False)
    return [llm.tokenize(t.encode("utf-8"), add_bos=False, special=True) if t else [] for t in texts]


def transformers_gguf_ids(path, texts):
    """transformers' GGUF tokenizer conversion, or None without transformers."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None, None
    import transformers
    d, f = os.path.split(os.path.abspath(path))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    return [tok.encode(t, add_special_tokens=False) for t in texts], transformers.__version__


def disagree(name, a_name, a, b_name, b, texts):
    bad = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    for i in bad:
        print(f"DISAGREE {name} {a_name} vs {b_name}: {texts[i]!r}\n  {a[i]}\n  {b[i]}")
    return bool(bad)


def gguf_ids(name, path, texts):
    """ids of `texts` from HF tokenizers on the rebuilt tokenizer.json, cross-checked
    against llama.cpp (and, for Qwen, transformers' GGUF tokenizer); None on disagreement."""
    import tokenizers
    tok = Tokenizer.from_str(json.dumps(gguf_to_tokenizer_json(path)))
    hf = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    for t, ids in zip(texts, hf):
        assert tok.decode(ids, skip_special_tokens=False) == t, (name, t)
    pre = "Digits + ByteLevel" if name == NAME_SMOLLM2 else "NFC + Split(Qwen2 regex) + ByteLevel"
    ref = f"HF tokenizers {tokenizers.__version__} on a tokenizer.json rebuilt from the GGUF ({pre})"
    if name == NAME_QWEN:
        tf, ver = transformers_gguf_ids(path, texts)
        if tf is None:
            ref += "; transformers not installed, its GGUF tokenizer not cross-checked"
        elif disagree(name, "rebuilt", hf, "transformers-gguf", tf, texts):
            return None, None
        else:
            ref += f"; identical to transformers {ver}'s GGUF tokenizer (AutoTokenizer gguf_file=)"
    lc = llama_cpp_ids(path, texts)
    if lc is None:
        ref += "; llama-cpp-python not installed, not cross-checked"
    elif disagree(name, "rebuilt", hf, "llama.cpp", lc, texts):
        return None, None
    else:
        import llama_cpp
        ref += f"; identical to llama.cpp's tokenizer (llama-cpp-python {llama_cpp.__version__})"
    return hf, ref


def main():
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["tiny", NAME_SMOLLM2, NAME_QWEN],
                    help="regenerate this entry only, keep the others from the existing file")
    a = ap.parse_args()
    path = os.path.join(DATA, "tokenizer_golden.json")
    old = {}
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if old.get("texts") != TEXTS:
            old = {}  # the shared texts changed: nothing old can be kept
    out = {"texts": TEXTS, "ids": {}, "extra_texts": {}, "extra_ids": {}, "reference": {}}

    def keep(name):
        if name in old.get("ids", {}):
            out["ids"][name] = old["ids"][name]
            out["reference"][name] = old["reference"][name]
            if name in old.get("extra_ids", {}):
                out["extra_texts"][name] = old["extra_texts"][name]
                out["extra_ids"][name] = old["extra_ids"][name]
            print("kept", name, "from the existing file")

    for name in ("tiny-llama", "tiny-qwen2", "tiny-qwen3"):
        if a.only not in (None, "tiny"):
            keep(name)
            continue
        tok = Tokenizer.from_file(os.path.join(DATA, name, "tokenizer.json"))
        out["ids"][name] = [tok.encode(t, add_special_tokens=False).ids for t in TEXTS]
        for t, ids in zip(TEXTS, out["ids"][name]):
            assert tok.decode(ids, skip_special_tokens=False) == t, (name, t)
        out["reference"][name] = "HF tokenizers on tokenizer.json"
    for name, gguf, extra, fetch in ((NAME_SMOLLM2, GGUF, [], "scripts/fetch_model.sh"),
                                     (NAME_QWEN, QWEN_GGUF, QWEN_TEXTS, "scripts/fetch_qwen.sh")):
        if a.only not in (None, name):
            keep(name)
            continue
        if not os.path.exists(gguf):
            print("note: no", gguf, f"- {name} ids not regenerated (run {fetch})")
            keep(name)
            continue
        ids, ref = gguf_ids(name, gguf, TEXTS + extra)
        if ids is None:
            return 1
        out["ids"][name] = ids[:len(TEXTS)]
        out["reference"][name] = ref
        if extra:
            out["extra_texts"][name] = extra
            out["extra_ids"][name] = ids[len(TEXTS):]
    with open(path, "w") as f:
        json.dump(out, f, ensure_ascii=False, indent=0)
    print("wrote", path, {k: v for k, v in out["reference"].items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
