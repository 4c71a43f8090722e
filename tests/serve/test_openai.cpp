// Request parsing and response shapes of serve/openai.h for logprobs, echo and n, without a model
// or a network (test_http.py drives the same through a real server).
#include <gtest/gtest.h>

#include <string>

#include "serve/openai.h"

namespace oscar::serve {
namespace {

int status_of(const std::string& body, bool chat) {
  try {
    parse_completion_request(body, chat);
    return 200;
  } catch (const ApiError& e) {
    return e.status;
  }
}

TEST(OpenAiRequest, LogprobsEchoAndNParse) {
  auto c = parse_completion_request(R"({"prompt": "hi", "logprobs": 3, "echo": true, "n": 4, "best_of": 4})", false);
  EXPECT_EQ(c.logprobs, 3);
  EXPECT_TRUE(c.echo);
  EXPECT_EQ(c.n, 4);
  EXPECT_FALSE(c.seeded);
  EXPECT_EQ(parse_completion_request(R"({"prompt": "hi", "logprobs": false})", false).logprobs, -1);
  EXPECT_EQ(parse_completion_request(R"({"prompt": "hi", "logprobs": null})", false).logprobs, -1);
  EXPECT_EQ(parse_completion_request(R"({"prompt": "hi", "logprobs": 0})", false).logprobs, 0);
  EXPECT_TRUE(parse_completion_request(R"({"prompt": "hi", "seed": 0})", false).seeded);
  const std::string msgs = R"("messages": [{"role": "user", "content": "hi"}])";
  EXPECT_EQ(parse_completion_request("{" + msgs + R"(, "logprobs": true})", true).logprobs, 0);
  EXPECT_EQ(parse_completion_request("{" + msgs + R"(, "logprobs": true, "top_logprobs": 5})", true).logprobs, 5);
  EXPECT_EQ(parse_completion_request("{" + msgs + R"(, "logprobs": false})", true).logprobs, -1);
  EXPECT_TRUE(parse_completion_request(R"({"prompt": "hi", "return_tokens_as_token_ids": true})", false).tokens_as_ids);
  // Prompts: a string, ids, or a list of those.
  auto several = parse_completion_request(R"({"prompt": ["a", [1, 2], "b"]})", false);
  ASSERT_EQ(several.prompts.size(), 3u);
  EXPECT_FALSE(several.prompts[0].is_tokens);
  EXPECT_EQ(several.prompts[1].tokens, (std::vector<int>{1, 2}));
  EXPECT_EQ(several.prompts[2].text, "b");
  EXPECT_EQ(parse_completion_request(R"({"prompt": [7, 8]})", false).prompts.size(), 1u);

  for (const char* bad : {R"({"prompt": "hi", "logprobs": 21})", R"({"prompt": "hi", "logprobs": true})",
                          R"({"prompt": "hi", "logprobs": -1})", R"({"prompt": "hi", "logprobs": 1.5})",
                          R"({"prompt": "hi", "n": 0})", R"({"prompt": "hi", "n": 65})",
                          R"({"prompt": "hi", "n": 2, "best_of": 3})", R"({"prompt": "hi", "echo": 1})",
                          R"({"prompt": ["a", 5]})", R"({"prompt": [[1], []]})", R"({"prompt": ["a", ""]})",
                          R"({"prompt": ["a", "b", "c", "d", "e"], "n": 60})"})
    EXPECT_EQ(status_of(bad, false), 400) << bad;
  for (const std::string& bad : {"{" + msgs + R"(, "top_logprobs": 2})", "{" + msgs + R"(, "logprobs": 2})",
                                 "{" + msgs + R"(, "logprobs": true, "top_logprobs": 21})",
                                 "{" + msgs + R"(, "echo": true})"})
    EXPECT_EQ(status_of(bad, true), 400) << bad;
}

// OpenAI's presence / frequency penalties reach the sampling parameters, in [-2, 2]; the
// repetition penalty and min_p (extensions) beside them.
TEST(OpenAiRequest, PenaltiesParse) {
  auto c = parse_completion_request(
      R"({"prompt": "hi", "presence_penalty": 0.6, "frequency_penalty": -1.5, "repetition_penalty": 1.2})", false);
  EXPECT_FLOAT_EQ(c.sampling.presence_penalty, 0.6f);
  EXPECT_FLOAT_EQ(c.sampling.frequency_penalty, -1.5f);
  EXPECT_FLOAT_EQ(c.sampling.repetition_penalty, 1.2f);
  EXPECT_FLOAT_EQ(parse_completion_request(R"({"prompt": "hi", "min_p": 0.05})", false).sampling.min_p, 0.05f);
  EXPECT_EQ(status_of(R"({"prompt": "hi", "min_p": 1.5})", false), 400);
  auto z = parse_completion_request(R"({"prompt": "hi", "presence_penalty": null})", false);
  EXPECT_EQ(z.sampling.presence_penalty, 0.0f);
  EXPECT_EQ(z.sampling.frequency_penalty, 0.0f);
  const std::string msgs = R"("messages": [{"role": "user", "content": "hi"}])";
  EXPECT_FLOAT_EQ(parse_completion_request("{" + msgs + R"(, "frequency_penalty": 2})", true).sampling.frequency_penalty,
                  2.0f);
  for (const char* bad : {R"({"prompt": "hi", "presence_penalty": 2.5})", R"({"prompt": "hi", "frequency_penalty": -3})",
                          R"({"prompt": "hi", "presence_penalty": "1"})"})
    EXPECT_EQ(status_of(bad, false), 400) << bad;
}

engine::TokenLogprob lp(int token, float v, std::vector<engine::TopLogprob> top = {}) {
  engine::TokenLogprob t;
  t.token = token;
  t.logprob = v;
  t.top = std::move(top);
  return t;
}

TEST(OpenAiResponse, CompletionLogprobsShapeAndOffsets) {
  // Token texts: 0 "a", 1 "é" (2 bytes, one character), 2 the first byte of a 3-byte character.
  const TokenBytes bytes = [](int id) {
    return id == 0 ? std::string("a") : id == 1 ? std::string("\xC3\xA9") : std::string("\xE2");
  };
  std::vector<LogprobEntry> e = {{lp(0, 0.f), false}, {lp(1, -0.5f, {{1, -0.5f}, {0, -1.5f}}), true},
                                 {lp(2, -2.f, {{1, -0.1f}}), true}};
  int64_t offset = 10;
  const nlohmann::json j = completion_logprobs(e, bytes, offset);
  EXPECT_EQ(j["text_offset"], nlohmann::json({10, 11, 12}));
  EXPECT_EQ(offset, 13);
  EXPECT_TRUE(j["token_logprobs"][0].is_null());
  EXPECT_TRUE(j["top_logprobs"][0].is_null());
  EXPECT_FLOAT_EQ(j["token_logprobs"][1].get<float>(), -0.5f);
  EXPECT_EQ(j["top_logprobs"][1].size(), 2u);  // "é" and "a"
  EXPECT_EQ(j["top_logprobs"][2].size(), 2u);  // its best ("é") and itself
  EXPECT_FLOAT_EQ(j["top_logprobs"][2]["\xE2"].get<float>(), -2.f);
  // Invalid UTF-8 in a token's text is replaced when the JSON is written, not an exception.
  EXPECT_NE(dump_json(j).find("\xEF\xBF\xBD"), std::string::npos);

  const nlohmann::json c = chat_logprobs(std::vector<engine::TokenLogprob>{lp(2, -2.f, {{1, -0.1f}})}, bytes);
  EXPECT_EQ(c["content"][0]["bytes"], nlohmann::json({0xE2}));
  EXPECT_EQ(c["content"][0]["top_logprobs"][0]["bytes"], nlohmann::json({0xC3, 0xA9}));
}

TEST(OpenAiResponse, ChoicesAreIndexed) {
  ResponseMeta m{"cmpl-1", "model", 1, false};
  const nlohmann::json r = completion_response(m, {{"x", "length", nullptr}, {"y", "stop", nullptr}}, 3, 4);
  ASSERT_EQ(r["choices"].size(), 2u);
  EXPECT_EQ(r["choices"][1]["index"], 1);
  EXPECT_EQ(r["choices"][1]["text"], "y");
  EXPECT_EQ(r["usage"]["total_tokens"], 7);
  const nlohmann::json k = completion_chunk(m, 3, "z", "", false);
  EXPECT_EQ(k["choices"][0]["index"], 3);
  EXPECT_TRUE(k["choices"][0]["finish_reason"].is_null());
  EXPECT_TRUE(k["choices"][0]["logprobs"].is_null());
}

}  // namespace
}  // namespace oscar::serve
