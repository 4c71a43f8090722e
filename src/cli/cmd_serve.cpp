// `oscar serve -m MODEL [--kv oscar --calib FILE]`: the OpenAI-compatible HTTP
// server (serve/server.h) over the continuous-batching scheduler. SIGINT or
// SIGTERM stops it gracefully: new requests get 503, running ones finish.
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "cli/registry.h"
#include "core/error.h"
#include "engine/async_engine.h"
#include "engine/scheduler.h"
#include "engine/session.h"
#include "kv/kv_cache.h"
#include "kv/quant_methods.h"
#include "model/forward.h"
#include "model/tokenizer.h"
#include "serve/server.h"

namespace {

// SIGINT / SIGTERM: the handler (any thread may run it; OpenBLAS starts threads
// before main, so masking signals is not enough) writes the signal number into a
// pipe that the waiter thread reads. A second signal exits at once.
int g_sig_pipe[2] = {-1, -1};
volatile sig_atomic_t g_signals = 0;
extern "C" void on_stop_signal(int sig) {
  if (g_signals) _exit(128 + sig);
  g_signals = 1;
  const char c = static_cast<char>(sig);
  [[maybe_unused]] ssize_t r = write(g_sig_pipe[1], &c, 1);
}

struct Opts {
  std::string model = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  std::string name;
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string api_key;
  std::string kv = "bf16";
  std::string calib;
  int page_size = 64;
  int64_t max_kv_tokens = 0;
  double kv_memory_mb = 0;
  double gpu_memory_utilization = 0.9;
  bool no_prefix_caching = false;
  std::string weights = "bf16";
  int threads = 0;
  std::string device = "cpu";
  int max_running = 32, max_waiting = 1024, max_batch_tokens = 0, max_model_len = 0;
  int http_threads = 0;
  size_t max_body = 8 << 20;
};

const oscar::cli::Registrar reg({"serve", "Serve a model over an OpenAI-compatible HTTP API (--device cpu or cuda)",
                                 [](CLI::App& app) {
  auto o = std::make_shared<Opts>();
  app.add_option("-m,--model", o->model, "GGUF file or Hugging Face directory")->capture_default_str();
  app.add_option("--served-model-name", o->name, "The id clients give as \"model\" (default: file name)");
  app.add_option("--host", o->host, "Address to listen on")->capture_default_str();
  app.add_option("--port", o->port, "Port (0 = any free port)")->capture_default_str();
  app.add_option("--api-key", o->api_key, "Require 'Authorization: Bearer KEY' on /v1 routes");
  app.add_option("--kv", o->kv, "KV cache method: bf16, oscar, kivi2, int2-hadamard, ...")->capture_default_str();
  app.add_option("--calib", o->calib, "Calibration file for --kv oscar (oscar calibrate)");
  app.add_option("--page-size", o->page_size, "KV page size in tokens")->capture_default_str();
  app.add_option("--max-kv-tokens", o->max_kv_tokens,
                 "KV memory budget in tokens over all requests (0 = 32768 on the CPU; on a GPU see "
                 "--gpu-memory-utilization)");
  app.add_option("--kv-memory-mb", o->kv_memory_mb,
                 "KV memory budget in MiB (instead of --max-kv-tokens): bf16 fills it with BF16 "
                 "pages; a 2-bit method keeps BF16 windows for --max-running sequences and fills "
                 "the rest with quantized pages");
  app.add_option("--gpu-memory-utilization", o->gpu_memory_utilization,
                 "On a GPU without --kv-memory-mb or --max-kv-tokens: the share of the device's memory the "
                 "weights and the KV pages may take (the rest: activations, kernels' scratch)")
      ->capture_default_str();
  app.add_flag("--no-prefix-caching", o->no_prefix_caching, "Do not share cached prompt prefixes");
  app.add_option("--weights", o->weights, "Weight storage: bf16 or f32")->capture_default_str();
  app.add_option("--device", o->device, "cpu, cuda or cuda:N (model, activations and KV pages on the GPU)")
      ->capture_default_str();
  app.add_option("-t,--threads", o->threads, "Compute threads (0 = all cores)");
  app.add_option("--max-running", o->max_running, "Most requests in the running batch")->capture_default_str();
  app.add_option("--max-waiting", o->max_waiting, "Queued requests beyond which new ones get 503")->capture_default_str();
  app.add_option("--max-batch-tokens", o->max_batch_tokens,
                 "Tokens per forward step (decode tokens + prefill chunks); 0 = 512 on the CPU, 8192 on a "
                 "GPU (a step's GEMMs fill the GPU from a few thousand rows)")->capture_default_str();
  app.add_option("--max-model-len", o->max_model_len, "Prompt + generation limit (0 = the model's)");
  app.add_option("--http-threads", o->http_threads, "HTTP worker threads (0 = 2 * max-running + 8)");
  app.add_option("--max-body-bytes", o->max_body, "Largest request body")->capture_default_str();
  return [o]() -> int {
    using namespace oscar;
    if (!std::filesystem::exists(o->model))
      throw Error(o->model + ": no such model (scripts/fetch_model.sh fetches the default)");
    if (pipe(g_sig_pipe) != 0) throw Error("serve: cannot create the signal pipe");
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
    std::signal(SIGPIPE, SIG_IGN);  // a client that vanishes must not kill the process

    if (o->max_batch_tokens < 0) throw Error("serve: --max-batch-tokens must be >= 0");
    if (o->max_batch_tokens == 0)
      o->max_batch_tokens = o->device == "cuda" || o->device.rfind("cuda:", 0) == 0 ? 8192 : 512;
    if (o->kv_memory_mb > 0 && o->max_kv_tokens > 0)
      throw Error("--kv-memory-mb and --max-kv-tokens both give the KV budget: give one of them");
    engine::Session sess = engine::open_session({o->model, o->kv, o->calib, o->weights, o->threads, o->device});
    model::Tokenizer& tok = sess.tok;
    model::Model* m = sess.model.get();
    const kv::KvMethod& km = sess.method;
    const bool prefix = !o->no_prefix_caching;
    const auto shape = m->cache_shape(o->page_size);
    std::unique_ptr<kv::KvCache> cache;
    const backend::PageStoreFactory store = sess.backend->page_store_factory();
    // On a GPU with no budget given, the pages take what the weights leave of
    // --gpu-memory-utilization of the device (32768 tokens would leave an H200 idle).
    const backend::Backend::MemoryInfo mem = sess.backend->device_memory();
    if (o->kv_memory_mb <= 0 && o->max_kv_tokens <= 0 && mem.total > 0)
      o->kv_memory_mb = double(engine::gpu_kv_budget(mem, o->gpu_memory_utilization)) / double(1 << 20);
    if (o->kv_memory_mb > 0) {
      cache = kv::make_method_cache_for_bytes(km, shape, int64_t(o->kv_memory_mb * (1 << 20)),
                                              o->max_running, o->max_batch_tokens, prefix, store);
    } else if (o->kv == "bf16") {
      kv::KvCacheOptions ko;
      ko.page_size = o->page_size;
      ko.max_tokens = o->max_kv_tokens > 0 ? o->max_kv_tokens : 32768;
      ko.prefix_caching = prefix;
      ko.store = store;
      cache = kv::make_kv_cache(shape, ko);
    } else {
      cache = kv::make_method_cache(km, shape, o->max_kv_tokens > 0 ? o->max_kv_tokens : 32768, prefix, store);
    }

    engine::SchedulerConfig sc;
    sc.max_running = o->max_running;
    sc.max_waiting = o->max_waiting;
    sc.max_batch_tokens = o->max_batch_tokens;
    sc.max_model_len = o->max_model_len;
    engine::Scheduler sched(*m, *cache, [&tok](int id) { return tok.token_str(id); }, sc);
    engine::AsyncEngine eng(sched);

    serve::ServerOptions so;
    so.host = o->host;
    so.port = o->port;
    so.api_key = o->api_key;
    so.model_name = o->name.empty() ? std::filesystem::path(o->model).filename().string() : o->name;
    so.http_threads = o->http_threads;
    so.max_body_bytes = o->max_body;
    serve::Server server(eng, sched, tok, so);
    server.bind();
    const auto usage = cache->usage();
    const double cap_mib = double(usage.total.bf16 * kv::bf16_page_bytes(shape) +
                                  usage.total.quant * kv::quant_page_bytes(km, shape)) / (1 << 20);
    std::fprintf(stderr,
                 "oscar serve: %s as \"%s\", kv %s (%lld bf16 + %lld quantized pages of %d tokens, "
                 "%.0f MiB%s), max %d running, %d tokens per step, context %d\n"
                 "listening on http://%s:%d  (Ctrl-C stops: running requests finish first)\n",
                 m->config().name.c_str(), so.model_name.c_str(), cache->method().c_str(),
                 static_cast<long long>(usage.total.bf16), static_cast<long long>(usage.total.quant),
                 o->page_size, cap_mib, prefix ? ", prefix caching" : "", sc.max_running, sc.max_batch_tokens, sched.config().max_model_len,
                 o->host.c_str(), server.port());
    std::fflush(stderr);

    std::thread waiter([&] {
      char c = 0;
      while (read(g_sig_pipe[0], &c, 1) < 0 && errno == EINTR) {
      }
      if (c != 0)
        std::fprintf(stderr, "oscar serve: signal %d, finishing running requests (again to quit now)...\n", c);
      server.stop();
    });
    server.listen();
    // listen() returns after stop(), or when the socket failed: wake the waiter then.
    const char zero = 0;
    [[maybe_unused]] ssize_t r = write(g_sig_pipe[1], &zero, 1);
    waiter.join();
    std::fprintf(stderr, "oscar serve: stopped\n");
    return 0;
  };
}});

}  // namespace
