// `oscar serve`: an OpenAI-compatible HTTP server over the continuous-batching
// scheduler (engine/async_engine.h), on cpp-httplib.
//
//   POST /v1/completions, /v1/chat/completions   (JSON, or Server-Sent Events with "stream")
//   GET  /v1/models, /health, /metrics (Prometheus text)
//
// Each HTTP request runs on one of the library's worker threads: it parses and
// tokenizes the request, submits it, then waits for the request's events (a
// per-request queue the loop thread fills) and writes them out. A streaming
// client that goes away aborts its request, which frees its pages.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "engine/async_engine.h"
#include "model/tokenizer.h"
#include "serve/chat_template.h"

namespace httplib {
class Server;
}

namespace oscar::serve {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string model_name;        // the id clients give as "model"
  std::string api_key;           // "" = no authentication
  size_t max_body_bytes = 8 << 20;
  int http_threads = 0;          // 0 = 2 * max_running + 8
};

class Server {
 public:
  Server(engine::AsyncEngine& engine, const engine::Scheduler& sched, const model::Tokenizer& tok,
         ServerOptions opts);
  ~Server();
  // Binds (port 0 = any free port; see port()). Throws oscar::Error when it cannot.
  void bind();
  int port() const { return port_; }
  // Serves until stop(); blocks.
  void listen();
  // Graceful: new requests get 503, what runs finishes, then listen() returns.
  void stop();

  // The /metrics text (for tests).
  std::string metrics_text();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace oscar::serve
