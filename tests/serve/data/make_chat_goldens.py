#!/usr/bin/env python3
"""Regenerates the chat-template goldens of tests/serve/test_chat_template.cpp.

    python3 tests/serve/data/make_chat_goldens.py   # from the repository root; needs jinja2 (3.1.6 used)

Reads tokenizer.chat_template and the bos/eos token strings from the two project models
(models/*.gguf, scripts/fetch_model.sh and scripts/fetch_qwen.sh), stores each template as
tests/serve/data/<name>.jinja and renders a few conversations with jinja2 the way Hugging Face
transformers does (ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True),
raise_exception defined, add_generation_prompt=True) into tests/serve/data/chat_goldens.json.
Content given as an array of text parts is joined with "\n" first (the OpenAI-server convention
of llama.cpp, which ChatTemplate::render follows); that is the only difference from a plain
transformers apply_chat_template call."""
import json, os, struct, sys
import jinja2, jinja2.sandbox

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..")
DATA = os.path.dirname(os.path.abspath(__file__))
MODELS = {"smollm2": "models/SmolLM2-135M-Instruct.Q4_1.gguf",
          "qwen2.5-coder": "models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf"}


def gguf_metadata(path):
    """The key/value metadata of a GGUF file (v2/v3), as a dict."""
    with open(path, "rb") as f:
        def rd(fmt):
            return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))[0]
        def string():
            return f.read(rd("Q")).decode("utf-8")
        scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
        def value(t):
            if t == 8: return string()
            if t == 9:
                et, n = rd("I"), rd("Q")
                return [value(et) for _ in range(n)]
            return rd(scalar[t])
        assert f.read(4) == b"GGUF", path
        rd("I"); rd("Q"); n_kv = rd("Q")
        out = {}
        for _ in range(n_kv):
            k = string()
            out[k] = value(rd("I"))
        return out


CONVERSATIONS = {
    "system_user": [{"role": "system", "content": "You are a terse assistant."},
                    {"role": "user", "content": "What is 2+2?"}],
    "user_only": [{"role": "user", "content": "Hello! Who are you?"}],
    "multi_turn": [{"role": "user", "content": "Name a prime."},
                   {"role": "assistant", "content": "7"},
                   {"role": "user", "content": "Another one, with \"quotes\" & <tags>\nand a newline."}],
    "parts": [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
              {"role": "user", "content": [{"type": "text", "text": "First part."},
                                           {"type": "text", "text": "Second part."}]}],
}


# Tool use (OpenAI form: tool_calls[].function.arguments a JSON string), rendered for the templates
# that handle tools themselves, with the arguments as objects (the form Hugging Face templates take;
# ChatTemplate::render converts, as llama.cpp's server does).
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_CONVERSATIONS = {
    "tools_offered": [{"role": "user", "content": "Weather in Paris?"}],
    "tool_round_trip": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}],
}
TOOL_TEMPLATES = {"qwen2.5-coder"}


def hf_form(messages):
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [dict(tc, function=dict(tc["function"], arguments=json.loads(tc["function"]["arguments"])))
                               for tc in m["tool_calls"]]
        out.append(m)
    return out


def flatten(messages):
    return [dict(m, content="\n".join(p["text"] for p in m["content"])) if isinstance(m["content"], list) else m
            for m in messages]


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def main():
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    # transformers' tojson (keys in order, no HTML escaping), not jinja2's (sorted, HTML-safe).
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    goldens = {}
    for name, rel in MODELS.items():
        md = gguf_metadata(os.path.join(ROOT, rel))
        tokens = md["tokenizer.ggml.tokens"]
        bos = tokens[md["tokenizer.ggml.bos_token_id"]] if "tokenizer.ggml.bos_token_id" in md else ""
        eos = tokens[md["tokenizer.ggml.eos_token_id"]] if "tokenizer.ggml.eos_token_id" in md else ""
        source = md["tokenizer.chat_template"]
        with open(os.path.join(DATA, name + ".jinja"), "w", encoding="utf-8", newline="") as f:
            f.write(source)
        tmpl = env.from_string(source)
        cases = []
        for conv, messages in CONVERSATIONS.items():
            for agp in (True, False):
                expected = tmpl.render(messages=flatten(messages), add_generation_prompt=agp,
                                       bos_token=bos, eos_token=eos)
                cases.append({"name": conv, "add_generation_prompt": agp, "messages": messages,
                              "expected": expected})
        tool_cases = []
        if name in TOOL_TEMPLATES:
            for conv, messages in TOOL_CONVERSATIONS.items():
                expected = tmpl.render(messages=hf_form(messages), tools=TOOLS, add_generation_prompt=True,
                                       bos_token=bos, eos_token=eos)
                tool_cases.append({"name": conv, "messages": messages, "tools": TOOLS, "expected": expected})
        goldens[name] = {"gguf": rel, "template": name + ".jinja", "bos_token": bos, "eos_token": eos,
                         "cases": cases, "tool_cases": tool_cases}
    with open(os.path.join(DATA, "chat_goldens.json"), "w", encoding="utf-8") as f:
        json.dump({"generator": "python3 tests/serve/data/make_chat_goldens.py (jinja2 " + jinja2.__version__ + ")",
                   "models": goldens}, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
