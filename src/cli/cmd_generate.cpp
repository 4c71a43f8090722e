// `oscar generate -m MODEL -p PROMPT -n N`: streams a continuation to stdout and
// ends with prompt and generation tokens/s on stderr.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <memory>
#include <string>

#include <fmt/format.h>

#include "cli/registry.h"
#include "core/error.h"
#include "engine/generator.h"
#include "engine/session.h"
#include "kv/kv_cache.h"
#include "kv/quant_methods.h"
#include "model/forward.h"
#include "model/tokenizer.h"

namespace {

struct Opts {
  std::string model = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  std::string prompt;
  std::string prompt_file;  // -f: a document placed before the -p text
  std::string system;
  int n = 128;
  float temp = 0.0f, top_p = 1.0f, min_p = 0.0f, repeat_penalty = 1.0f, presence_penalty = 0.0f,
        frequency_penalty = 0.0f;
  int top_k = 0;
  uint64_t seed = 0;
  std::vector<std::string> stops;
  bool ignore_eos = false, chat = false, quiet = false;
  std::string kv = "bf16";
  std::string calib;  // calibration file for --kv oscar (kv/quant_methods.h)
  int page_size = 64;
  int64_t max_kv_tokens = 0;
  std::string weights = "bf16";
  int threads = 0;
  std::string device = "cpu";
  int prefill_chunk = 512;
};

// ChatML (SmolLM2, Qwen): the models this project ships speak it. Other
// templates are not interpreted here; --chat refuses them rather than guess.
std::string chat_prompt(const oscar::model::Tokenizer& tok, const Opts& o) {
  if (tok.token_id("<|im_start|>") < 0 || tok.token_id("<|im_end|>") < 0)
    throw oscar::Error(o.model + ": --chat supports ChatML models only (no <|im_start|> token)");
  std::string p;
  if (!o.system.empty()) p += "<|im_start|>system\n" + o.system + "<|im_end|>\n";
  p += "<|im_start|>user\n" + o.prompt + "<|im_end|>\n<|im_start|>assistant\n";
  return p;
}

const oscar::cli::Registrar reg({"generate", "Generate text from a prompt (--device cpu or cuda)", [](CLI::App& app) {
  auto o = std::make_shared<Opts>();
  app.add_option("-m,--model", o->model, "GGUF file or Hugging Face directory")
      ->capture_default_str();
  app.add_option("-p,--prompt", o->prompt, "Prompt text (after the -f document, if any)");
  app.add_option("-f,--file", o->prompt_file,
                 "Read a document from this file and put it before the -p text (long prompts)");
  app.add_option("-n,--n-predict", o->n, "Tokens to generate")->capture_default_str();
  app.add_option("--temp", o->temp, "Temperature (0 = greedy)")->capture_default_str();
  app.add_option("--top-k", o->top_k, "Top-k (0 = off)")->capture_default_str();
  app.add_option("--top-p", o->top_p, "Top-p (1 = off)")->capture_default_str();
  app.add_option("--min-p", o->min_p, "Min-p: keep tokens of at least this times the best one's probability (0 = off)")
      ->capture_default_str();
  app.add_option("--repeat-penalty", o->repeat_penalty, "Repetition penalty (1 = off)")
      ->capture_default_str();
  app.add_option("--presence-penalty", o->presence_penalty,
                 "Presence penalty over the generated tokens, in [-2, 2] (0 = off; OpenAI's)")
      ->capture_default_str();
  app.add_option("--frequency-penalty", o->frequency_penalty,
                 "Frequency penalty over the generated tokens, in [-2, 2] (0 = off; OpenAI's)")
      ->capture_default_str();
  app.add_option("--seed", o->seed, "Sampling seed")->capture_default_str();
  app.add_option("--stop", o->stops, "Stop string (repeatable)");
  app.add_flag("--ignore-eos", o->ignore_eos, "Do not stop at the model's end-of-sequence tokens");
  app.add_flag("--chat", o->chat, "Wrap the prompt in the model's (ChatML) chat template");
  app.add_option("--system", o->system, "System message for --chat");
  app.add_option("--kv", o->kv, "KV cache method: bf16, int2-naive, int2-hadamard, int4-hadamard, kivi2, oscar, ...")
      ->capture_default_str();
  app.add_option("--calib", o->calib, "Calibration file for --kv oscar (oscar calibrate)");
  app.add_option("--page-size", o->page_size, "KV page size in tokens")->capture_default_str();
  app.add_option("--max-kv-tokens", o->max_kv_tokens, "KV page budget in tokens (0 = auto)");
  app.add_option("--weights", o->weights, "Weight storage: bf16 or f32")->capture_default_str();
  app.add_option("--device", o->device, "cpu, cuda or cuda:N (model, activations and KV pages on the GPU)")
      ->capture_default_str();
  app.add_option("-t,--threads", o->threads, "Threads (0 = all cores)");
  app.add_option("--prefill-chunk", o->prefill_chunk, "Prompt tokens per forward call")
      ->capture_default_str();
  app.add_flag("-q,--quiet", o->quiet, "Do not print the timing summary");
  return [o]() -> int {
    using namespace oscar;
    if (o->n < 0) throw Error("-n must be >= 0");
    if (!o->prompt_file.empty()) {
      std::ifstream in(o->prompt_file, std::ios::binary);
      if (!in) throw Error(o->prompt_file + ": cannot open prompt file");
      std::stringstream ss;
      ss << in.rdbuf();
      o->prompt = ss.str() + (o->prompt.empty() ? "" : "\n\n" + o->prompt);
    }
    if (o->prompt.empty()) throw Error("give a prompt with -p and/or -f");
    if (!std::filesystem::exists(o->model))
      throw Error(o->model + ": no such model (scripts/fetch_model.sh fetches the default)");
    const auto t0 = std::chrono::steady_clock::now();
    engine::Session sess = engine::open_session({o->model, o->kv, o->calib, o->weights, o->threads, o->device});
    model::Tokenizer& tok = sess.tok;
    backend::Backend* be = sess.backend.get();
    model::Model* m = sess.model.get();
    const kv::KvMethod& km = sess.method;
    const double load_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    engine::Request req;
    req.prompt = tok.encode(o->chat ? chat_prompt(tok, *o) : o->prompt, true);
    if (req.prompt.empty()) throw Error("the prompt encodes to no tokens");
    req.max_new_tokens = o->n;
    req.sampling = {o->temp, o->top_k, o->top_p, o->repeat_penalty, o->seed, o->presence_penalty, o->frequency_penalty,
                    o->min_p};
    if (!o->ignore_eos) req.stop_tokens = tok.eos();
    req.stop_strings = o->stops;

    kv::KvCacheOptions ko;
    ko.method = o->kv;
    ko.page_size = o->page_size;
    ko.max_tokens = o->max_kv_tokens > 0
                        ? o->max_kv_tokens
                        : int64_t(req.prompt.size()) + o->n + o->page_size;
    ko.store = be->page_store_factory();
    auto cache = o->kv == "bf16"
                     ? kv::make_kv_cache(m->cache_shape(o->page_size), ko)
                     : kv::make_method_cache(km, m->cache_shape(o->page_size), ko.max_tokens,
                                             false, ko.store);

    engine::Generator gen(*m, *cache, [&tok](int id) { return tok.token_str(id); },
                          o->prefill_chunk);
    auto res = gen.run({&req, 1}, [](int, std::string_view s) {
      std::fwrite(s.data(), 1, s.size(), stdout);
      std::fflush(stdout);
    });
    std::fputc('\n', stdout);
    if (!o->quiet) {
      const auto& st = gen.stats();
      // The first generated token comes out of the prefill; the generation
      // rate is over the decode steps that produced the rest.
      std::fprintf(stderr,
                   "\n[%s, kv %s, %s]\nload %.2f s | prompt: %d tokens, %.1f tokens/s | "
                   "generation: %d tokens, %.1f tokens/s over %d decode steps (%s)\n",
                   m->config().name.c_str(), cache->method().c_str(), be->name().c_str(), load_s,
                   st.prompt_tokens, st.prefill_tok_s(), st.generated_tokens, st.decode_tok_s(),
                   st.decode_tokens, res[0].finish_reason.c_str());
    }
    return 0;
  };
}});

}  // namespace
