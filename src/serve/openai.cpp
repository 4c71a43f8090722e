#include "serve/openai.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace oscar::serve {

using json = nlohmann::json;

json ApiError::body() const {
  json e = {{"message", what()}, {"type", type}, {"param", nullptr}, {"code", nullptr}};
  if (!param.empty()) e["param"] = param;
  if (!code.empty()) e["code"] = code;
  return {{"error", e}};
}

namespace {

ApiError bad(const std::string& param, const std::string& msg) {
  return ApiError(400, msg, "invalid_request_error", param);
}

// A number field that must be finite and in [lo, hi]; absent or null = keep.
template <typename T>
void number(const nlohmann::ordered_json& j, const char* key, T& out, double lo, double hi) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return;
  if (!it->is_number()) throw bad(key, fmt::format("'{}' must be a number", key));
  if constexpr (std::is_integral_v<T>) {
    if (!it->is_number_integer() && !(it->is_number_float() && std::floor(it->get<double>()) == it->get<double>()))
      throw bad(key, fmt::format("'{}' must be an integer", key));
  }
  const double v = it->get<double>();
  if (!std::isfinite(v) || v < lo || v > hi)
    throw bad(key, fmt::format("'{}' must be in [{}, {}] (got {})", key, lo, hi, it->dump()));
  out = static_cast<T>(v);
}

bool boolean(const nlohmann::ordered_json& j, const char* key, bool def) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return def;
  if (!it->is_boolean()) throw bad(key, fmt::format("'{}' must be a boolean", key));
  return it->get<bool>();
}

std::vector<int> token_list(const nlohmann::ordered_json& a) {
  std::vector<int> out;
  out.reserve(a.size());
  for (const auto& t : a) {
    if (!t.is_number_integer())
      throw bad("prompt", "a token-id prompt must hold integers only");
    const int64_t v = t.get<int64_t>();
    if (v < 0 || v > std::numeric_limits<int>::max())
      throw bad("prompt", fmt::format("token id {} is out of range", v));
    out.push_back(static_cast<int>(v));
  }
  return out;
}

}  // namespace

CompletionRequest parse_completion_request(const std::string& body, bool chat) {
  nlohmann::ordered_json j;
  try {
    j = nlohmann::ordered_json::parse(body);
  } catch (const nlohmann::json::exception& e) {  // parse_error, and out_of_range for 1e400
    throw ApiError(400, std::string("the body is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) throw ApiError(400, "the body must be a JSON object");
  CompletionRequest r;
  r.chat = chat;
  if (auto it = j.find("model"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) throw bad("model", "'model' must be a string");
    r.model = it->get<std::string>();
  }
  if (chat) {
    auto it = j.find("messages");
    if (it == j.end()) throw bad("messages", "'messages' is required");
    if (!it->is_array() || it->empty())
      throw bad("messages", "'messages' must be a non-empty array");
    r.messages = *it;
    if (auto t = j.find("tools"); t != j.end() && !t->is_null()) {
      if (!t->is_array()) throw bad("tools", "'tools' must be an array");
      if (t->size() > size_t(kMaxTools)) throw bad("tools", fmt::format("at most {} tools", kMaxTools));
      for (size_t i = 0; i < t->size(); ++i) {
        const auto& tool = (*t)[i];
        const auto where = fmt::format("tools[{}]", i);
        if (!tool.is_object() || tool.value("type", "") != "function")
          throw bad("tools", where + " must be {\"type\": \"function\", \"function\": {...}}");
        const auto f = tool.find("function");
        if (f == tool.end() || !f->is_object()) throw bad("tools", where + ".function must be an object");
        const auto name = f->find("name");
        if (name == f->end() || !name->is_string() || name->get_ref<const std::string&>().empty())
          throw bad("tools", where + ".function.name must be a non-empty string");
        if (const auto d = f->find("description"); d != f->end() && !d->is_string())
          throw bad("tools", where + ".function.description must be a string");
        if (const auto p = f->find("parameters"); p != f->end() && !p->is_object())
          throw bad("tools", where + ".function.parameters must be a JSON Schema object");
      }
      if (!t->empty()) r.tools = *t;
    }
    if (auto c = j.find("tool_choice"); c != j.end() && !c->is_null()) {
      if (*c == "none") r.tools = nullptr;
      else if (*c != "auto")
        throw bad("tool_choice", "only tool_choice 'auto' and 'none' are supported ('required' and a named function "
                                 "need constrained decoding)");
    }
    (void)boolean(j, "parallel_tool_calls", true);
  } else {
    auto it = j.find("prompt");
    if (it == j.end() || it->is_null()) throw bad("prompt", "'prompt' is required");
    const auto& p = *it;
    auto text_prompt = [&](const nlohmann::ordered_json& v) {
      CompletionRequest::Prompt q;
      q.text = v.get<std::string>();
      if (q.text.empty()) throw bad("prompt", "'prompt' is empty");
      r.prompts.push_back(std::move(q));
    };
    auto token_prompt = [&](const nlohmann::ordered_json& v) {
      CompletionRequest::Prompt q;
      q.is_tokens = true;
      q.tokens = token_list(v);
      if (q.tokens.empty()) throw bad("prompt", "'prompt' is empty");
      r.prompts.push_back(std::move(q));
    };
    if (p.is_string()) {
      text_prompt(p);
    } else if (p.is_array()) {
      // A string, a list of token ids, or a list of those (several prompts).
      if (p.empty()) throw bad("prompt", "'prompt' is empty");
      if (p[0].is_number()) {
        token_prompt(p);
      } else {
        if (p.size() > size_t(kMaxPrompts)) throw bad("prompt", fmt::format("at most {} prompts per request", kMaxPrompts));
        for (const auto& q : p) {
          if (q.is_string()) text_prompt(q);
          else if (q.is_array()) token_prompt(q);
          else throw bad("prompt", "'prompt' must be a string, a list of token ids or a list of those");
        }
      }
    } else {
      throw bad("prompt", "'prompt' must be a string or an array");
    }
  }

  const double kMaxTok = 1 << 30;
  number(j, "max_tokens", r.max_tokens, 0, kMaxTok);
  if (chat) number(j, "max_completion_tokens", r.max_tokens, 0, kMaxTok);
  if (!chat && r.max_tokens < 0) r.max_tokens = 16;  // the OpenAI default for completions
  number(j, "temperature", r.sampling.temperature, 0, 2);
  number(j, "top_p", r.sampling.top_p, 0, 1);
  if (j.contains("top_p") && r.sampling.top_p <= 0) throw bad("top_p", "'top_p' must be > 0");
  int top_k = 0;
  number(j, "top_k", top_k, -1, 1 << 30);
  r.sampling.top_k = top_k < 0 ? 0 : top_k;
  number(j, "repetition_penalty", r.sampling.repetition_penalty, 1e-3, 100);
  int64_t seed = 0;
  number(j, "seed", seed, static_cast<double>(std::numeric_limits<int64_t>::min()),
         static_cast<double>(std::numeric_limits<int64_t>::max()));
  r.sampling.seed = static_cast<uint64_t>(seed);
  r.seeded = j.contains("seed") && !j["seed"].is_null();
  number(j, "n", r.n, 1, kMaxChoices);
  if (r.prompts.size() * size_t(r.n) > size_t(kMaxChoices) * 4)
    throw bad("n", fmt::format("{} prompts × n = {} is more than {} choices", r.prompts.size(), r.n, kMaxChoices * 4));
  number(j, "min_p", r.sampling.min_p, 0, 1);
  number(j, "presence_penalty", r.sampling.presence_penalty, -2, 2);
  number(j, "frequency_penalty", r.sampling.frequency_penalty, -2, 2);
  if (chat) {
    // `logprobs`: a boolean; `top_logprobs` (alternatives) only with it.
    const bool want = boolean(j, "logprobs", false);
    int top = -1;
    number(j, "top_logprobs", top, 0, engine::kMaxLogprobs);
    if (top >= 0 && !want) throw bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
    r.logprobs = want ? std::max(top, 0) : -1;
    if (boolean(j, "echo", false)) throw bad("echo", "'echo' is not supported for chat completions");
  } else {
    // `logprobs`: the number of alternatives (false / null: none).
    if (auto it = j.find("logprobs"); it != j.end() && !it->is_null() && *it != false) {
      if (it->is_boolean())
        throw bad("logprobs", fmt::format("'logprobs' must be an integer in [0, {}]", engine::kMaxLogprobs));
      number(j, "logprobs", r.logprobs, 0, engine::kMaxLogprobs);
    }
    r.echo = boolean(j, "echo", false);
  }
  if (auto it = j.find("best_of"); it != j.end() && !it->is_null()) {
    int best_of = 1;
    number(j, "best_of", best_of, 1, kMaxChoices);
    if (best_of != r.n) throw bad("best_of", "only best_of = n is supported");
  }

  if (auto it = j.find("stop"); it != j.end() && !it->is_null()) {
    if (it->is_string()) {
      r.stop.push_back(it->get<std::string>());
    } else if (it->is_array()) {
      if (it->size() > 16) throw bad("stop", "at most 16 stop strings");
      for (const auto& s : *it) {
        if (!s.is_string()) throw bad("stop", "'stop' must hold strings");
        r.stop.push_back(s.get<std::string>());
      }
    } else {
      throw bad("stop", "'stop' must be a string or an array of strings");
    }
    for (const auto& s : r.stop)
      if (s.empty()) throw bad("stop", "stop strings must not be empty");
  }
  r.stream = boolean(j, "stream", false);
  if (auto it = j.find("stream_options"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) throw bad("stream_options", "'stream_options' must be an object");
    r.include_usage = boolean(*it, "include_usage", false);
  }
  r.ignore_eos = boolean(j, "ignore_eos", false);
  r.tokens_as_ids = boolean(j, "return_tokens_as_token_ids", false);
  return r;
}

json usage_json(int prompt_tokens, int completion_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens}};
}

static json head(const ResponseMeta& m, const char* object) {
  return {{"id", m.id}, {"object", object}, {"created", m.created}, {"model", m.model}};
}

static json reason(const std::string& r) { return r.empty() ? json(nullptr) : json(r); }

json completion_response(const ResponseMeta& m, const std::vector<Choice>& choices, int prompt_tokens,
                         int completion_tokens) {
  json out = head(m, m.chat ? "chat.completion" : "text_completion");
  json arr = json::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const Choice& c = choices[i];
    json choice = {{"index", i}};
    if (m.chat) {
      const bool blank = c.text.find_first_not_of(" \t\r\n") == std::string::npos;
      choice["message"] = {{"role", "assistant"},
                           {"content", !c.tool_calls.is_null() && blank ? json(nullptr) : json(c.text)}};
      if (!c.tool_calls.is_null()) choice["message"]["tool_calls"] = c.tool_calls;
    } else
      choice["text"] = c.text;
    choice["logprobs"] = c.logprobs;
    choice["finish_reason"] = reason(c.finish_reason);
    arr.push_back(std::move(choice));
  }
  out["choices"] = std::move(arr);
  out["usage"] = usage_json(prompt_tokens, completion_tokens);
  return out;
}

json completion_chunk(const ResponseMeta& m, int index, const std::string& text,
                      const std::string& finish_reason, bool first, const json& logprobs, const json& tool_calls) {
  json out = head(m, m.chat ? "chat.completion.chunk" : "text_completion");
  json choice = {{"index", index}};
  if (m.chat) {
    json delta = json::object();
    if (first) delta["role"] = "assistant";
    if (!text.empty() || (first && tool_calls.is_null())) delta["content"] = text;
    if (!tool_calls.is_null()) delta["tool_calls"] = tool_calls;
    choice["delta"] = delta;
  } else {
    choice["text"] = text;
  }
  choice["logprobs"] = logprobs;
  choice["finish_reason"] = reason(finish_reason);
  out["choices"] = json::array({choice});
  return out;
}

namespace {

// Characters (code points) of a token's bytes as a client decodes them: bytes that do not
// continue a UTF-8 sequence.
int64_t code_points(const std::string& s) {
  int64_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

json byte_list(const std::string& s) {
  json a = json::array();
  for (unsigned char c : s) a.push_back(int(c));
  return a;
}

}  // namespace

json tool_calls_json(const std::vector<ToolCall>& calls, const std::vector<std::string>& ids, bool streamed) {
  json out = json::array();
  for (size_t i = 0; i < calls.size(); ++i) {
    json c = {{"id", ids.at(i)}, {"type", "function"},
              {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments}}}};
    if (streamed) c["index"] = i;
    out.push_back(std::move(c));
  }
  return out;
}

json completion_logprobs(std::span<const LogprobEntry> entries, const TokenBytes& bytes, int64_t& offset) {
  json tokens = json::array(), lps = json::array(), tops = json::array(), offs = json::array();
  for (const LogprobEntry& e : entries) {
    const std::string t = bytes(e.lp.token);
    tokens.push_back(t);
    offs.push_back(offset);
    offset += code_points(t);
    if (!e.known) {
      lps.push_back(nullptr);
      tops.push_back(nullptr);
      continue;
    }
    lps.push_back(e.lp.logprob);
    json top = json::object();
    for (const engine::TopLogprob& a : e.lp.top) top[bytes(a.token)] = a.logprob;
    top[t] = e.lp.logprob;
    tops.push_back(std::move(top));
  }
  return {{"tokens", tokens}, {"token_logprobs", lps}, {"top_logprobs", tops}, {"text_offset", offs}};
}

json chat_logprobs(std::span<const engine::TokenLogprob> entries, const TokenBytes& bytes) {
  json content = json::array();
  for (const engine::TokenLogprob& e : entries) {
    const std::string t = bytes(e.token);
    json top = json::array();
    for (const engine::TopLogprob& a : e.top) {
      const std::string ta = bytes(a.token);
      top.push_back({{"token", ta}, {"logprob", a.logprob}, {"bytes", byte_list(ta)}});
    }
    content.push_back({{"token", t}, {"logprob", e.logprob}, {"bytes", byte_list(t)}, {"top_logprobs", top}});
  }
  return {{"content", content}};
}

json usage_chunk(const ResponseMeta& m, int prompt_tokens, int completion_tokens) {
  json out = head(m, m.chat ? "chat.completion.chunk" : "text_completion");
  out["choices"] = json::array();
  out["usage"] = usage_json(prompt_tokens, completion_tokens);
  return out;
}

std::string dump_json(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace oscar::serve
