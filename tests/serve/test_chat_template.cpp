// serve::ChatTemplate (minja) against the reference implementation, Python's
// jinja2 with transformers' settings.
//
// Goldens: tests/serve/data/chat_goldens.json and the two models' templates
// (tests/serve/data/smollm2.jinja, qwen2.5-coder.jinja, copied verbatim from
// the GGUFs' tokenizer.chat_template) were made by
//     python3 tests/serve/data/make_chat_goldens.py      (jinja2 3.1.6)
// which renders each conversation with
//     jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
//         .from_string(template).render(messages=..., add_generation_prompt=...,
//                                       bos_token=..., eos_token=...)
// (raise_exception defined as transformers does; content given as text parts
// joined with "\n" first, the convention ChatTemplate::render follows).
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "../model/test_gguf_writer.h"
#include "core/error.h"
#include "model/tokenizer.h"
#include "serve/chat_template.h"

namespace fs = std::filesystem;
using nlohmann::ordered_json;
using oscar::serve::ChatTemplate;

namespace {

const std::string kData = std::string(OSCAR_SOURCE_DIR) + "/tests/serve/data/";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const ordered_json& goldens() {
  static const ordered_json j = ordered_json::parse(read_file(kData + "chat_goldens.json"));
  return j;
}

ChatTemplate golden_template(const std::string& model) {
  const ordered_json& g = goldens().at("models").at(model);
  return ChatTemplate(read_file(kData + g.at("template").get<std::string>()), g.at("bos_token").get<std::string>(),
                      g.at("eos_token").get<std::string>());
}

void expect_goldens(const ChatTemplate& t, const std::string& model) {
  const ordered_json& cases = goldens().at("models").at(model).at("cases");
  ASSERT_GE(cases.size(), 8u);
  for (const ordered_json& c : cases) {
    const bool agp = c.at("add_generation_prompt").get<bool>();
    SCOPED_TRACE(model + " / " + c.at("name").get<std::string>() + (agp ? " / generation prompt" : ""));
    EXPECT_EQ(t.render(c.at("messages"), agp), c.at("expected").get<std::string>());
  }
}

// Expects `f` to throw oscar::Error whose message contains every needle.
template <typename F>
void expect_error(F&& f, const std::vector<std::string>& needles) {
  try {
    f();
    ADD_FAILURE() << "no error thrown; expected one mentioning '" << needles.at(0) << "'";
  } catch (const oscar::Error& e) {
    const std::string m = e.what();
    for (const auto& n : needles) EXPECT_NE(m.find(n), std::string::npos) << "message: " << m;
  }
}

std::string tmp_path(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("oscar_test_serve_" + std::to_string(::getpid()));
  fs::create_directories(d);
  return (d / name).string();
}

// A GGUF holding only a tiny byte-level BPE tokenizer (ids 0..2 special).
std::string tiny_tokenizer_gguf(const std::string& name, const std::string& chat_template) {
  oscar::test::GgufWriter w;
  w.kv_str("tokenizer.ggml.model", "gpt2");
  w.kv_strs("tokenizer.ggml.tokens", {"<s>", "</s>", "<eot>", "a", "b", "c"});
  w.kv_i32s("tokenizer.ggml.token_type", {3, 3, 3, 1, 1, 1});
  w.kv_strs("tokenizer.ggml.merges", {});
  w.kv_u32("tokenizer.ggml.bos_token_id", 0);
  w.kv_u32("tokenizer.ggml.eos_token_id", 1);
  w.kv_u32("tokenizer.ggml.eot_token_id", 2);
  if (!chat_template.empty()) w.kv_str("tokenizer.chat_template", chat_template);
  const std::string path = tmp_path(name);
  w.write(path);
  return path;
}

const ordered_json kSystemUser = ordered_json::parse(R"([
  {"role": "system", "content": "Be terse."},
  {"role": "user", "content": "Hi"}])");

const ordered_json kMultiTurn = ordered_json::parse(R"([
  {"role": "system", "content": "Be terse."},
  {"role": "user", "content": "Hi"},
  {"role": "assistant", "content": "Hello."},
  {"role": "user", "content": "Bye"}])");

}  // namespace

// --- reference outputs ------------------------------------------------------

TEST(ChatTemplate, SmolLM2MatchesJinja2) {
  const ChatTemplate t = golden_template("smollm2");
  EXPECT_FALSE(t.is_fallback());
  EXPECT_TRUE(t.supports_system_role());
  expect_goldens(t, "smollm2");
}

TEST(ChatTemplate, QwenCoderMatchesJinja2) {
  const ChatTemplate t = golden_template("qwen2.5-coder");
  EXPECT_TRUE(t.supports_system_role());
  expect_goldens(t, "qwen2.5-coder");
}

// Tool use in OpenAI's form (arguments as JSON text) against transformers' rendering of the same
// conversation (arguments as objects): the template's own tool prompt, the call, the response.
TEST(ChatTemplate, QwenCoderToolsMatchJinja2) {
  const ChatTemplate t = golden_template("qwen2.5-coder");
  EXPECT_TRUE(t.supports_tools());
  const ordered_json& cases = goldens().at("models").at("qwen2.5-coder").at("tool_cases");
  ASSERT_EQ(cases.size(), 2u);
  for (const ordered_json& c : cases) {
    SCOPED_TRACE(c.at("name").get<std::string>());
    EXPECT_EQ(t.render(c.at("messages"), true, c.at("tools")), c.at("expected").get<std::string>());
  }
}

// A template without tool support (SmolLM2's) gets the tools described in its system message, and
// calls and responses as JSON text; malformed tool calls are refused by name.
TEST(ChatTemplate, ToolsArePolyfilledAndMalformedCallsRefused) {
  const ChatTemplate t = golden_template("smollm2");
  EXPECT_FALSE(t.supports_tools());
  const ordered_json& qc = goldens().at("models").at("qwen2.5-coder").at("tool_cases");
  const ordered_json tools = qc.at(0).at("tools");
  const std::string offered = t.render(qc.at(0).at("messages"), true, tools);
  EXPECT_NE(offered.find("get_weather"), std::string::npos) << offered;
  const std::string round = t.render(qc.at(1).at("messages"), true, tools);
  EXPECT_NE(round.find("\"tool_calls\""), std::string::npos) << round;
  EXPECT_NE(round.find("18 C, sunny"), std::string::npos) << round;
  EXPECT_EQ(t.render(qc.at(0).at("messages"), true), t.render(qc.at(0).at("messages"), true, ordered_json::array()));
  auto with_call = [&](const char* call) {
    ordered_json m = ordered_json::parse(R"([{"role": "user", "content": "x"}, {"role": "assistant", "content": null}])");
    m[1]["tool_calls"] = ordered_json::parse(call);
    return t.render(m, true, tools);
  };
  expect_error([&] { with_call(R"({"id": 1})"); }, {"tool_calls must be an array"});
  expect_error([&] { with_call(R"([{"type": "function", "function": {"arguments": "{}"}}])"); }, {"function.name"});
  expect_error([&] { with_call(R"([{"function": {"name": "f", "arguments": "{not json"}}])"); }, {"not valid JSON"});
  expect_error([&] { with_call(R"([{"type": "code", "function": {"name": "f", "arguments": "{}"}}])"); }, {"type must be"});
  expect_error([&] {
    t.render(ordered_json::parse(R"([{"role": "user", "content": null}])"), true, tools);
  }, {"content must be a string"});
}

// The models' own templates, through the tokenizer (GGUF metadata).
TEST(ChatTemplate, FromTokenizerOfProjectModelsMatchesJinja2) {
  int found = 0;
  for (const auto& [model, g] : goldens().at("models").items()) {
    const std::string gguf = std::string(OSCAR_SOURCE_DIR) + "/" + g.at("gguf").get<std::string>();
    if (!fs::exists(gguf)) continue;
    ++found;
    SCOPED_TRACE(gguf);
    const ChatTemplate t = ChatTemplate::from_tokenizer(oscar::model::load_tokenizer(gguf));
    EXPECT_FALSE(t.is_fallback());
    EXPECT_EQ(t.source(), read_file(kData + g.at("template").get<std::string>()));
    EXPECT_EQ(t.bos_token(), g.at("bos_token").get<std::string>());
    EXPECT_EQ(t.eos_token(), g.at("eos_token").get<std::string>());
    expect_goldens(t, model);
  }
  if (found == 0) GTEST_SKIP() << "no models/*.gguf: run scripts/fetch_model.sh and scripts/fetch_qwen.sh";
}

// --- ChatML fallback --------------------------------------------------------

TEST(ChatTemplate, FallbackIsChatML) {
  const std::string path = tiny_tokenizer_gguf("no_template.gguf", "");
  const ChatTemplate t = ChatTemplate::from_tokenizer(oscar::model::load_tokenizer(path));
  EXPECT_TRUE(t.is_fallback());
  EXPECT_EQ(t.source(), ChatTemplate::chatml_source());
  EXPECT_EQ(t.render(kMultiTurn),
            "<|im_start|>system\nBe terse.<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello.<|im_end|>\n"
            "<|im_start|>user\nBye<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(t.render(kSystemUser, /*add_generation_prompt=*/false),
            "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
  // Same text as the hand-built ChatTemplate of the same source.
  EXPECT_FALSE(ChatTemplate(ChatTemplate::chatml_source(), "", "").is_fallback());
}

TEST(ChatTemplate, FromTokenizerPassesItsBosEosStrings) {
  const std::string path = tiny_tokenizer_gguf(
      "bos_eos.gguf", "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}");
  const ChatTemplate t = ChatTemplate::from_tokenizer(oscar::model::load_tokenizer(path));
  EXPECT_FALSE(t.is_fallback());
  EXPECT_EQ(t.bos_token(), "<s>");
  EXPECT_EQ(t.eos_token(), "</s>");  // eos_token_id, not eot
  EXPECT_EQ(t.render(kSystemUser), "<s>[system]Be terse.</s>[user]Hi</s>");
}

// --- errors -----------------------------------------------------------------

TEST(ChatTemplate, UnparsableTemplateThrows) {
  expect_error([] { ChatTemplate("{% for m in messages %}{{ m.content }}", "", ""); }, {"chat template does not parse"});
  expect_error([] { ChatTemplate("{{ messages[0].content ", "", ""); }, {"chat template does not parse"});
  expect_error([] { ChatTemplate("{% if add_generation_prompt %}x{% endfor %}", "", ""); },
               {"chat template does not parse"});
}

TEST(ChatTemplate, BadMessagesThrowReadableErrors) {
  const ChatTemplate t(ChatTemplate::chatml_source(), "", "");
  auto bad = [&](const char* messages, std::vector<std::string> needles) {
    SCOPED_TRACE(messages);
    expect_error([&] { t.render(ordered_json::parse(messages)); }, needles);
  };
  bad(R"({"role": "user", "content": "hi"})", {"'messages' must be an array", "object"});
  bad(R"("hello")", {"'messages' must be an array", "string"});
  bad(R"(null)", {"'messages' must be an array"});
  bad(R"([])", {"at least one message"});
  bad(R"([{"role": "user", "content": "hi"}, "hi"])", {"messages[1] must be an object", "string"});
  bad(R"([{"content": "hi"}])", {"messages[0] has no 'role'"});
  bad(R"([{"role": 3, "content": "hi"}])", {"messages[0].role must be a non-empty string", "number"});
  bad(R"([{"role": "", "content": "hi"}])", {"messages[0].role must be a non-empty string"});
  bad(R"([{"role": "user"}])", {"messages[0] has no 'content'"});
  bad(R"([{"role": "user", "content": "a"}, {"role": "user", "content": 42}])",
      {"messages[1].content must be a string or an array of text parts", "number"});
  bad(R"([{"role": "user", "content": null}])", {"messages[0].content", "null"});
  bad(R"([{"role": "user", "content": {"text": "hi"}}])", {"messages[0].content", "object"});
  bad(R"([{"role": "user", "content": ["hi"]}])", {"messages[0].content[0] must be an object"});
  bad(R"([{"role": "user", "content": [{"text": "hi"}]}])", {"messages[0].content[0] has no string 'type'"});
  bad(R"([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]}])",
      {"messages[0].content[1]", "'image_url'", "not supported"});
  bad(R"([{"role": "user", "content": [{"type": "text", "text": 1}]}])", {"messages[0].content[0].text must be a string"});
}

TEST(ChatTemplate, TemplateRaiseExceptionBecomesError) {
  // Llama-2 style role check.
  const ChatTemplate t(
      "{% for message in messages %}"
      "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
      "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
      "{% endif %}"
      "{{ '[' + message['role'] + '] ' + message['content'] + '\\n' }}"
      "{% endfor %}",
      "", "");
  EXPECT_EQ(t.render(ordered_json::parse(R"([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])")),
            "[user] a\n[assistant] b\n");
  try {
    t.render(ordered_json::parse(R"([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])"));
    ADD_FAILURE() << "no error";
  } catch (const oscar::Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("chat template: Conversation roles must alternate user/assistant/user/assistant/...", 0), 0u)
        << m;
    EXPECT_NE(m.find("(chat template row 1, column "), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << "location context not stripped: " << m;
  }
  // Other runtime errors too (minja is laxer than jinja2 here: "a" + 1 renders "a1").
  const ChatTemplate u("{{ messages[0].content.nope() }}", "", "");
  expect_error([&] { u.render(kSystemUser); }, {"chat template: Unknown method: nope (chat template row 1, column 24)"});
}

// --- polyfills --------------------------------------------------------------

TEST(ChatTemplate, SystemRoleIsMergedWhenTemplateRefusesIt) {
  // Gemma style: no system role.
  const ChatTemplate t(
      "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
      "{% for message in messages %}"
      "{{ '<' + message['role'] + '>' + message['content'] + '</' + message['role'] + '>' }}"
      "{% endfor %}"
      "{% if add_generation_prompt %}<model>{% endif %}",
      "", "");
  EXPECT_FALSE(t.supports_system_role());
  EXPECT_EQ(t.render(kMultiTurn), "<user>Be terse.\nHi</user><assistant>Hello.</assistant><user>Bye</user><model>");
  EXPECT_EQ(t.render(ordered_json::parse(R"([{"role": "user", "content": "Hi"}])")), "<user>Hi</user><model>");
}

TEST(ChatTemplate, TextPartsAreJoinedWithNewlines) {
  const ChatTemplate t(ChatTemplate::chatml_source(), "", "");
  const ordered_json parts = ordered_json::parse(R"([{"role": "user", "content": [
      {"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}])");
  EXPECT_EQ(t.render(parts, false), "<|im_start|>user\none\ntwo<|im_end|>\n");
  EXPECT_EQ(t.render(ordered_json::parse(R"([{"role": "user", "content": []}])"), false),
            "<|im_start|>user\n<|im_end|>\n");
}

TEST(ChatTemplate, ExtraFieldsAreNotPassedOn) {
  const ChatTemplate t("{% for m in messages %}{{ m.role }}:{{ m.name }}:{{ m.audio is defined }};{% endfor %}",
                       "", "");
  EXPECT_EQ(t.render(ordered_json::parse(
                R"([{"role": "user", "content": "x", "name": "bob", "audio": [{"id": 1}]}])")),
            "user:bob:False;");
  // tool_calls belong to assistant messages only
  EXPECT_THROW(t.render(ordered_json::parse(
                   R"([{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}])")),
               oscar::Error);
}

// --- threads ----------------------------------------------------------------

TEST(ChatTemplate, ConcurrentRendersAgree) {
  const ChatTemplate qwen = golden_template("qwen2.5-coder");
  // strftime_now makes render() take a lock: exercise that path as well.
  const ChatTemplate dated(
      "{{ strftime_now('%Y') }}|{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}", "", "");
  const std::string want_qwen = qwen.render(kMultiTurn);
  const std::string want_dated = dated.render(kMultiTurn);
  ASSERT_NE(want_qwen.find("<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"), std::string::npos);
  constexpr int kThreads = 8, kIters = 200;
  std::vector<int> mismatches(kThreads, 0), errors(kThreads, 0);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      for (int k = 0; k < kIters; ++k) {
        try {
          if (qwen.render(kMultiTurn) != want_qwen) ++mismatches[i];
          if (k % 10 == 0 && dated.render(kMultiTurn) != want_dated) ++mismatches[i];
        } catch (const std::exception&) {
          ++errors[i];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int i = 0; i < kThreads; ++i) {
    EXPECT_EQ(mismatches[i], 0) << "thread " << i;
    EXPECT_EQ(errors[i], 0) << "thread " << i;
  }
}

TEST(ChatTemplate, CopiesShareTheParsedTemplate) {
  const ChatTemplate a = golden_template("smollm2");
  const ChatTemplate b = a;  // NOLINT(performance-unnecessary-copy-initialization)
  EXPECT_EQ(a.render(kSystemUser), b.render(kSystemUser));
  EXPECT_EQ(&a.source(), &b.source());
}

// A template is a stranger's code (it comes in the model file): integer division
// or modulo by zero used to raise SIGFPE inside minja and kill the server. It must
// be an error the caller can report, from the constructor (which probes the
// template by rendering) or from render.
TEST(ChatTemplate, ArithmeticFaultsAreErrors) {
  // Overflow, zero-step and unbounded ranges and repetition (which looped forever or
  // allocated without bound) are errors too.
  for (const char* src : {"{{ 1 // 0 }}", "{{ 7 % 0 }}", "{{ 1 / 0 }}",
                          "{{ (-9223372036854775807 - 1) // -1 }}",
                          "{% for m in messages %}{{ m['content'] }}{{ loop.index // (loop.index - 1) }}{% endfor %}",
                          "{{ 9223372036854775807 + 1 }}", "{{ -9223372036854775807 - 2 }}",
                          "{{ 4611686018427387904 * 4 }}", "{% for i in range(1, 10, 0) %}{% endfor %}",
                          "{% for i in range(10, 1, 0) %}{% endfor %}", "{{ range(1000000000) | length }}",
                          "{{ 'abc' * 100000000000 }}"}) {
    EXPECT_THROW(
        {
          const ChatTemplate t(src, "<s>", "</s>");
          (void)t.render(kSystemUser);
        },
        oscar::Error)
        << src;
  }
  // Arithmetic, ranges and repetition that are fine still render.
  const ChatTemplate ok("{{ 7 // 2 }} {{ 7 % 4 }} {{ -7 // -1 }} {{ range(2, 11, 3) | join(',') }} "
                        "{{ range(5, 0, -2) | join(',') }} {{ 'ab' * 3 }} {{ 3 * -4 + 1 - 2 }}",
                        "<s>", "</s>");
  EXPECT_EQ(ok.render(kSystemUser, false), "3 3 7 2,5,8 5,3,1 ababab -13");
}
