#include "serve/server.h"

#include <fmt/format.h>
#include <httplib.h>
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdlib>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <limits>
#include <mutex>
#include <random>

#include "serve/openai.h"

namespace oscar::serve {

using json = nlohmann::json;
using engine::RequestEvent;

namespace {

// Events of one request, filled by the engine's loop thread, drained by the
// HTTP worker that serves the request.
struct Channel {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<RequestEvent> q;
  void push(const RequestEvent& e) {
    {
      std::lock_guard lk(mu);
      q.push_back(e);
    }
    cv.notify_one();
  }
  // Waits up to `timeout` for an event.
  bool pop(RequestEvent& out, std::chrono::milliseconds timeout) {
    std::unique_lock lk(mu);
    if (!cv.wait_for(lk, timeout, [&] { return !q.empty(); })) return false;
    out = std::move(q.front());
    q.pop_front();
    return true;
  }
};

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(dump_json(e.body()), "application/json");
}

std::string sse(const json& j) { return "data: " + dump_json(j) + "\n\n"; }

// The socket of a request's connection, found by its addresses: cpp-httplib 0.11 (Debian's) does
// not hand it to handlers, and a non-streamed request must notice a client that went away while
// it waits. The handler runs on the connection's thread, which closes the socket only after the
// handler returns, so the descriptor stays this connection's while we hold it. -1 when not found.
int connection_socket(const httplib::Request& req) {
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return -1;
  int found = -1;
  while (dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0') continue;
    sockaddr_storage local{}, peer{};
    socklen_t ll = sizeof(local), pl = sizeof(peer);
    if (getsockname(int(fd), reinterpret_cast<sockaddr*>(&local), &ll) != 0) continue;
    if (getpeername(int(fd), reinterpret_cast<sockaddr*>(&peer), &pl) != 0) continue;
    auto port_addr = [](const sockaddr_storage& a, std::string* addr) {
      char buf[INET6_ADDRSTRLEN] = {};
      if (a.ss_family == AF_INET) {
        const auto* v4 = reinterpret_cast<const sockaddr_in*>(&a);
        if (addr) *addr = inet_ntop(AF_INET, &v4->sin_addr, buf, sizeof(buf)) ? buf : "";
        return int(ntohs(v4->sin_port));
      }
      if (a.ss_family == AF_INET6) {
        const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&a);
        if (addr) *addr = inet_ntop(AF_INET6, &v6->sin6_addr, buf, sizeof(buf)) ? buf : "";
        return int(ntohs(v6->sin6_port));
      }
      return -1;
    };
    std::string peer_addr;
    if (port_addr(local, nullptr) == req.local_port && port_addr(peer, &peer_addr) == req.remote_port &&
        peer_addr == req.remote_addr) {
      found = int(fd);
      break;
    }
  }
  closedir(dir);
  return found;
}

// True when the peer has closed the connection (end of stream or an error on the socket).
// Pipelined bytes of a next request do not count. (A client that half-closes its side after
// sending, which HTTP clients do not do, would read as gone.)
bool peer_closed(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLERR | POLLHUP | POLLNVAL)) return true;
  char c;
  const ssize_t n = ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

}  // namespace

struct Server::Impl {
  engine::AsyncEngine& engine;
  const engine::Scheduler& sched;
  const model::Tokenizer& tok;
  ServerOptions opts;
  ChatTemplate tmpl;
  ToolFormat tool_fmt;  // how this model's tool calls look (serve/tool_calls.h)
  std::vector<int> eos;  // stop tokens unless ignore_eos
  httplib::Server http;
  std::atomic<bool> stopping{false};
  int listen_fd = -1;  // the listening socket, to raise the library's backlog of 5
  std::atomic<int64_t> next_id{1};
  std::atomic<int64_t> http_errors_4xx{0}, http_errors_5xx{0};
  std::mutex rate_mu;
  std::chrono::steady_clock::time_point rate_t = std::chrono::steady_clock::now();
  int64_t rate_tokens = 0;
  double rate = 0;

  Impl(engine::AsyncEngine& e, const engine::Scheduler& s, const model::Tokenizer& t,
       ServerOptions o)
      : engine(e), sched(s), tok(t), opts(std::move(o)), tmpl(ChatTemplate::from_tokenizer(t)),
        tool_fmt(tool_format(tmpl)) {
    eos = tok.eos();
    // Chat turns end with the template's end-of-turn token even when the model's
    // metadata names another end-of-sequence token.
    for (const char* s : {"<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>"}) {
      const int id = tok.token_id(s);
      if (id >= 0 && std::find(eos.begin(), eos.end(), id) == eos.end()) eos.push_back(id);
    }
  }

  void check_auth(const httplib::Request& req) const {
    if (opts.api_key.empty()) return;
    const std::string want = "Bearer " + opts.api_key;
    if (req.get_header_value("Authorization") != want)
      throw ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                     "invalid_request_error", "", "invalid_api_key");
  }

  // A request's `model`: empty (not given) or the served one; else a 404.
  void check_model(const std::string& name) const {
    if (!name.empty() && name != opts.model_name)
      throw ApiError(404, fmt::format("the model '{}' does not exist; this server serves '{}'", name,
                                      opts.model_name),
                     "invalid_request_error", "model", "model_not_found");
  }

  // Runs a route's body; an ApiError becomes its JSON answer, anything else a 500, both counted
  // for /metrics.
  template <typename F>
  void answer(httplib::Response& res, F&& body) {
    try {
      body();
    } catch (const ApiError& e) {
      ++(e.status >= 500 ? http_errors_5xx : http_errors_4xx);
      send_error(res, e);
    } catch (const std::exception& e) {
      ++http_errors_5xx;
      send_error(res, ApiError(500, e.what(), "server_error"));
    }
  }

  // Engine requests for each prompt of `cr` (chat: its one rendered conversation), in order.
  std::vector<engine::Request> to_engine(const CompletionRequest& cr) const {
    check_model(cr.model);
    engine::Request r;
    r.max_new_tokens = cr.max_tokens < 0 ? std::numeric_limits<int>::max() : cr.max_tokens;
    r.sampling = cr.sampling;
    r.stop_strings = cr.stop;
    if (!cr.ignore_eos) r.stop_tokens = eos;
    std::vector<engine::Request> out;
    if (cr.chat) {
      std::string text;
      try {
        text = tmpl.render(cr.messages, true, cr.tools);
      } catch (const Error& e) {
        throw ApiError(400, e.what(), "invalid_request_error", "messages");
      }
      // Templates that write the BOS themselves must not get a second one.
      const int bos = tok.bos();
      const bool has_bos = bos >= 0 && text.starts_with(tok.token_text(bos));
      r.prompt = tok.encode(text, !has_bos);
      out.push_back(r);
    } else {
      for (const CompletionRequest::Prompt& p : cr.prompts) {
        r.prompt = p.is_tokens ? p.tokens : tok.encode(p.text, true);
        out.push_back(r);
      }
    }
    for (const engine::Request& q : out)
      if (q.prompt.empty()) throw ApiError(400, "the prompt encodes to no tokens", "invalid_request_error", "prompt");
    return out;
  }

  // One HTTP request's choices: n engine requests (seeds seed, seed + 1, ...) whose events share
  // one channel, and what each choice has produced so far.
  struct ChoiceState {
    std::string text;
    std::vector<engine::TokenLogprob> prompt_lps;  // echo: the prompt's, as they arrive
    std::vector<LogprobEntry> lps;                 // the choice's logprobs entries (non-streamed)
    int64_t offset = 0;                            // text_offset of the next entry
    bool echo_sent = false, first = true, finished = false;
    std::string finish_reason;
    int completion_tokens = 0;
    int prompt = 0;  // its prompt's index
    size_t sent = 0;  // streamed with tools: bytes of `text` sent as content
  };
  struct PromptInfo {
    std::vector<int> tokens;  // echo's logprobs
    std::string echo_text;    // the prompt as echoed
  };
  struct Job {
    CompletionRequest cr;
    ResponseMeta meta;
    std::vector<PromptInfo> prompts;
    std::vector<int> stop_tokens;  // end generation; not listed in logprobs
    std::vector<engine::RequestId> ids;
    std::shared_ptr<Channel> ch = std::make_shared<Channel>();
    std::vector<ChoiceState> st;
    int prompt_tokens = 0;
    int index_of(engine::RequestId id) const {
      for (size_t i = 0; i < ids.size(); ++i)
        if (ids[i] == id) return static_cast<int>(i);
      return -1;
    }
    // The drawn tokens of an event as logprobs entries (stop tokens left out).
    std::vector<engine::TokenLogprob> token_lps(const RequestEvent& e) const {
      std::vector<engine::TokenLogprob> out;
      for (size_t k = 0; k < e.logprobs.size(); ++k)
        if (std::find(stop_tokens.begin(), stop_tokens.end(), e.logprobs[k].token) == stop_tokens.end())
          out.push_back(e.logprobs[k]);
      return out;
    }
    bool echo_logprobs() const { return cr.echo && cr.logprobs >= 0; }
    bool tools() const { return cr.chat && !cr.tools.is_null(); }
    std::vector<std::string> tool_names() const {
      std::vector<std::string> v;
      if (tools())
        for (const auto& t : cr.tools) v.push_back(t.at("function").at("name").get<std::string>());
      return v;
    }
    // Echo with logprobs: the prompt's entries, its first token without one.
    std::vector<LogprobEntry> echo_entries(const ChoiceState& c) const {
      std::vector<LogprobEntry> v;
      engine::TokenLogprob first;
      first.token = prompts[size_t(c.prompt)].tokens[0];
      v.push_back({first, false});
      for (const auto& lp : c.prompt_lps) v.push_back({lp, true});
      return v;
    }
  };

  void abort_all(const Job& job) {
    for (engine::RequestId id : job.ids) engine.abort(id);
  }

  void completions(const httplib::Request& req, httplib::Response& res, bool chat) {
    answer(res, [&] {
      check_auth(req);
      if (stopping) throw ApiError(503, "the server is shutting down", "server_error");
      auto job = std::make_shared<Job>();
      job->cr = parse_completion_request(req.body, chat);
      const CompletionRequest& cr = job->cr;
      std::vector<engine::Request> ers = to_engine(cr);
      job->stop_tokens = ers[0].stop_tokens;
      for (size_t p = 0; p < ers.size(); ++p) {
        PromptInfo info{ers[p].prompt, {}};
        if (cr.echo) {
          const auto& q = cr.prompts[p];
          info.echo_text = q.is_tokens ? tok.decode(q.tokens) : q.text;
        }
        job->prompts.push_back(std::move(info));
        job->prompt_tokens += static_cast<int>(ers[p].prompt.size());
      }
      const uint64_t seed = cr.seeded ? cr.sampling.seed : next_seed();
      // Choice index = prompt * n + j (OpenAI's order); choice j of each prompt draws with seed + j.
      const int n_choices = static_cast<int>(ers.size()) * cr.n;
      job->st.resize(size_t(n_choices));
      auto ch = job->ch;
      try {
        for (int i = 0; i < n_choices; ++i) {
          engine::Request ri = ers[size_t(i / cr.n)];
          ri.logprobs = cr.logprobs;
          ri.prompt_logprobs = job->echo_logprobs() ? cr.logprobs : -1;
          ri.sampling.seed = seed + uint64_t(i % cr.n);
          job->st[size_t(i)].prompt = i / cr.n;
          job->ids.push_back(engine.submit(std::move(ri), [ch](const RequestEvent& e) { ch->push(e); }));
        }
      } catch (const engine::Rejected& e) {
        abort_all(*job);
        throw ApiError(e.kind == engine::Rejected::kInvalid ? 400 : 503, e.what(),
                       e.kind == engine::Rejected::kInvalid ? "invalid_request_error"
                                                            : "server_error");
      }
      job->meta = ResponseMeta{fmt::format("{}-{}", chat ? "chatcmpl" : "cmpl", next_id++), opts.model_name,
                               unix_now(), chat};
      if (cr.stream) return stream(res, job);
      const int fd = connection_socket(req);
      auto checked = std::chrono::steady_clock::now();
      int left = n_choices;
      RequestEvent e;
      while (left > 0) {
        const bool got = ch->pop(e, std::chrono::milliseconds(100));
        if (const auto now = std::chrono::steady_clock::now(); now - checked >= std::chrono::milliseconds(100)) {
          checked = now;
          if (peer_closed(fd)) {  // the client went away: free the pages now, answer nobody
            abort_all(*job);
            return;
          }
        }
        if (!got) continue;
        const int i = job->index_of(e.id);
        if (i < 0) continue;
        ChoiceState& c = job->st[size_t(i)];
        c.text += e.text;
        c.prompt_lps.insert(c.prompt_lps.end(), e.prompt_logprobs.begin(), e.prompt_logprobs.end());
        for (auto& lp : job->token_lps(e)) c.lps.push_back({std::move(lp), true});
        if (!e.finished) continue;
        c.finished = true;
        c.finish_reason = e.finish_reason;
        c.completion_tokens = e.completion_tokens;
        --left;
        if (e.finish_reason == "error") {
          abort_all(*job);
          throw ApiError(e.error.find("forward failed") == std::string::npos ? 400 : 500, e.error, "server_error");
        }
      }
      std::vector<Choice> choices;
      int completion_tokens = 0;
      for (ChoiceState& c : job->st) {
        Choice out{cr.echo ? job->prompts[size_t(c.prompt)].echo_text + c.text : c.text, c.finish_reason, nullptr};
        if (job->tools()) {
          ToolParse tp = parse_tool_calls(c.text, tool_fmt, job->tool_names());
          if (!tp.calls.empty()) {
            out.text = std::move(tp.content);
            out.tool_calls = tool_calls_json(tp.calls, call_ids(tp.calls.size()), false);
            if (out.finish_reason == "stop") out.finish_reason = "tool_calls";
          }
        }
        if (cr.logprobs >= 0) {
          if (chat) {
            std::vector<engine::TokenLogprob> v;
            for (auto& en : c.lps) v.push_back(std::move(en.lp));
            out.logprobs = chat_logprobs(v, token_bytes(*job));
          } else {
            std::vector<LogprobEntry> v = job->echo_logprobs() ? job->echo_entries(c) : std::vector<LogprobEntry>{};
            v.insert(v.end(), c.lps.begin(), c.lps.end());
            int64_t offset = 0;
            out.logprobs = completion_logprobs(v, token_bytes(*job), offset);
          }
        }
        completion_tokens += c.completion_tokens;
        choices.push_back(std::move(out));
      }
      res.set_content(dump_json(completion_response(job->meta, choices, job->prompt_tokens, completion_tokens)),
                      "application/json");
    });
  }

  TokenBytes token_bytes(const Job& job) const {
    if (job.cr.tokens_as_ids) return [](int id) { return fmt::format("token_id:{}", id); };
    return [this](int id) { return tok.token_str(id); };
  }

  // Ids of tool calls: "call_" and 24 hex digits, unique in this process.
  std::vector<std::string> call_ids(size_t n) {
    std::vector<std::string> ids;
    for (size_t i = 0; i < n; ++i) ids.push_back(fmt::format("call_{:016x}{:08x}", next_seed(), uint32_t(call_counter++)));
    return ids;
  }
  std::atomic<uint64_t> call_counter{0};

  uint64_t next_seed() {
    // Requests without a seed draw differently from each other (OpenAI's behaviour); a seed makes
    // a request repeatable.
    static std::atomic<uint64_t> counter{std::random_device{}() * 0x9E3779B97F4A7C15ull};
    return counter.fetch_add(0x9E3779B97F4A7C15ull) ^ 0xD1B54A32D192ED03ull;
  }

  // Server-sent events: each engine event of choice i becomes a chunk with index i; with echo, a
  // choice first sends the prompt (with its logprobs once they have all come).
  void stream(httplib::Response& res, std::shared_ptr<Job> job) {
    struct State {
      bool done = false;
    };
    auto st = std::make_shared<State>();
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, job, st](size_t, httplib::DataSink& sink) {
          auto write = [&](const std::string& s) {
            if (!sink.write(s.data(), s.size())) throw std::runtime_error("client gone");
          };
          const CompletionRequest& cr = job->cr;
          const bool chat = job->meta.chat;
          // The choice's echo chunk, when it is due and not sent.
          auto echo = [&](int i) {
            ChoiceState& c = job->st[size_t(i)];
            if (!cr.echo || c.echo_sent) return;
            const PromptInfo& p = job->prompts[size_t(c.prompt)];
            if (job->echo_logprobs() && c.prompt_lps.size() + 1 < p.tokens.size()) return;
            json lp = nullptr;
            if (job->echo_logprobs()) lp = completion_logprobs(job->echo_entries(c), token_bytes(*job), c.offset);
            else c.offset = 0;
            write(sse(completion_chunk(job->meta, i, p.echo_text, "", false, lp)));
            c.echo_sent = true;
            c.first = false;
          };
          try {
            const int choices = static_cast<int>(job->st.size());
            for (int i = 0; i < choices; ++i) echo(i);
            RequestEvent e;
            int left = choices;
            auto idle = std::chrono::steady_clock::now();
            while (left > 0) {
              if (!job->ch->pop(e, std::chrono::milliseconds(100))) {
                if (!sink.is_writable()) throw std::runtime_error("client gone");
                // A comment line now and then, so a vanished client is noticed
                // while the request waits in the queue.
                if (std::chrono::steady_clock::now() - idle > std::chrono::seconds(1)) {
                  write(": keep-alive\n\n");
                  idle = std::chrono::steady_clock::now();
                }
                continue;
              }
              idle = std::chrono::steady_clock::now();
              const int i = job->index_of(e.id);
              if (i < 0) continue;
              ChoiceState& c = job->st[size_t(i)];
              if (e.finished && e.finish_reason == "error") {
                write(sse(ApiError(500, e.error, "server_error").body()));
                abort_all(*job);
                break;
              }
              if (e.finished && e.finish_reason == "abort") {
                abort_all(*job);
                break;
              }
              c.prompt_lps.insert(c.prompt_lps.end(), e.prompt_logprobs.begin(), e.prompt_logprobs.end());
              echo(i);
              const std::vector<engine::TokenLogprob> lps = job->token_lps(e);
              json lp = nullptr;
              if (cr.logprobs >= 0 && !lps.empty()) {
                if (chat) {
                  lp = chat_logprobs(lps, token_bytes(*job));
                } else {
                  std::vector<LogprobEntry> v;
                  for (const auto& x : lps) v.push_back({x, true});
                  lp = completion_logprobs(v, token_bytes(*job), c.offset);
                }
              }
              // With tools, text that may be part of a call is held back; at the finish the calls
              // go out whole in one delta.
              std::string text = e.text;
              json calls = nullptr;
              std::string reason = e.finished ? e.finish_reason : "";
              if (job->tools()) {
                c.text += e.text;
                if (!e.finished) {
                  const size_t safe = tool_safe_prefix(c.text, tool_fmt);
                  text = safe > c.sent ? c.text.substr(c.sent, safe - c.sent) : std::string();
                  c.sent = std::max(c.sent, safe);
                } else {
                  ToolParse tp = parse_tool_calls(c.text, tool_fmt, job->tool_names());
                  if (tp.calls.empty()) {
                    text = c.text.substr(c.sent);
                  } else {
                    text = tp.content.size() > c.sent ? tp.content.substr(c.sent) : std::string();
                    calls = tool_calls_json(tp.calls, call_ids(tp.calls.size()), true);
                    if (reason == "stop") reason = "tool_calls";
                  }
                }
              }
              // Chat's first chunk carries the role even without text.
              if (!text.empty() || !lp.is_null() || e.finished || (chat && c.first)) {
                if (!calls.is_null() && (!text.empty() || c.first)) {  // content first, then the calls
                  write(sse(completion_chunk(job->meta, i, text, "", c.first, lp)));
                  c.first = false;
                  text.clear();
                  lp = nullptr;
                }
                write(sse(completion_chunk(job->meta, i, text, reason, c.first, lp, calls)));
                c.first = false;
              }
              if (e.finished) {
                c.finished = true;
                c.completion_tokens = e.completion_tokens;
                --left;
              }
            }
            if (left == 0) {
              if (cr.include_usage) {
                int completion_tokens = 0;
                for (const ChoiceState& c : job->st) completion_tokens += c.completion_tokens;
                write(sse(usage_chunk(job->meta, job->prompt_tokens, completion_tokens)));
              }
            }
            write("data: [DONE]\n\n");
            st->done = true;
            sink.done();
            return true;
          } catch (const std::exception&) {
            abort_all(*job);  // frees their pages
            return false;
          }
        },
        [this, job, st](bool success) {
          if (!success || !st->done) abort_all(*job);
        });
  }

  // POST /tokenize {"prompt": text, "add_special_tokens": true} or {"messages": [...]} (rendered
  // with the chat template, generation prompt added): the ids the completion routes would feed.
  // POST /detokenize {"tokens": [ids]}: their text. (vLLM's routes of the same names.)
  void tokenize(const httplib::Request& req, httplib::Response& res, bool inverse) {
    answer(res, [&] {
      check_auth(req);
      nlohmann::ordered_json j;
      try {
        j = nlohmann::ordered_json::parse(req.body);
      } catch (const nlohmann::json::exception& e) {
        throw ApiError(400, std::string("the body is not valid JSON: ") + e.what());
      }
      if (!j.is_object()) throw ApiError(400, "the body must be a JSON object");
      if (auto it = j.find("model"); it != j.end() && !it->is_null()) {
        if (!it->is_string()) throw ApiError(400, "'model' must be a string", "invalid_request_error", "model");
        check_model(it->get<std::string>());
      }
      if (inverse) {
        auto it = j.find("tokens");
        if (it == j.end() || !it->is_array()) throw ApiError(400, "'tokens' must be a list of token ids", "invalid_request_error", "tokens");
        std::vector<int> ids;
        for (const auto& t : *it) {
          if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= tok.vocab_size())
            throw ApiError(400, fmt::format("token id {} is outside the vocabulary [0, {})", t.dump(), tok.vocab_size()),
                           "invalid_request_error", "tokens");
          ids.push_back(t.get<int>());
        }
        res.set_content(dump_json({{"prompt", tok.decode(ids)}}), "application/json");
        return;
      }
      std::vector<int> ids;
      if (j.contains("messages")) {
        ids = to_engine(parse_completion_request(req.body, true))[0].prompt;
      } else {
        auto it = j.find("prompt");
        if (it == j.end() || !it->is_string())
          throw ApiError(400, "'prompt' (a string) or 'messages' is required", "invalid_request_error", "prompt");
        bool special = true;
        if (auto s = j.find("add_special_tokens"); s != j.end() && !s->is_null()) {
          if (!s->is_boolean()) throw ApiError(400, "'add_special_tokens' must be a boolean", "invalid_request_error", "add_special_tokens");
          special = s->get<bool>();
        }
        ids = tok.encode(it->get<std::string>(), special);
      }
      res.set_content(dump_json({{"tokens", ids}, {"count", ids.size()}, {"max_model_len", sched.config().max_model_len}}),
                      "application/json");
    });
  }

  std::string metrics_text() {
    const auto s = engine.snapshot();
    const auto& m = s.metrics;
    std::string o;
    auto metric = [&](const char* name, const char* type, const char* help) {
      o += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
    };
    auto line = [&](const std::string& name, double v) { o += fmt::format("{} {}\n", name, v); };
    auto hist = [&](const char* name, const char* help, const engine::Histogram& h) {
      metric(name, "histogram", help);
      for (size_t i = 0; i < h.le.size(); ++i)
        o += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, h.le[i], h.counts[i]);
      o += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, h.count, name,
                       h.sum, name, h.count);
    };
    metric("oscar_requests_running", "gauge", "Requests in the running batch.");
    line("oscar_requests_running", s.running);
    metric("oscar_requests_waiting", "gauge", "Requests waiting to be admitted.");
    line("oscar_requests_waiting", s.waiting);
    metric("oscar_kv_pages_total", "gauge", "KV pages in the pools, by dtype.");
    o += fmt::format("oscar_kv_pages_total{{dtype=\"bf16\"}} {}\n", s.kv.total.bf16);
    o += fmt::format("oscar_kv_pages_total{{dtype=\"quant\"}} {}\n", s.kv.total.quant);
    metric("oscar_kv_pages_used", "gauge", "KV pages in use, by dtype.");
    o += fmt::format("oscar_kv_pages_used{{dtype=\"bf16\"}} {}\n", s.kv.used.bf16);
    o += fmt::format("oscar_kv_pages_used{{dtype=\"quant\"}} {}\n", s.kv.used.quant);
    metric("oscar_kv_pages_cached", "gauge", "Prefix-cache pages kept without holders (reusable, evicted when needed), by dtype.");
    o += fmt::format("oscar_kv_pages_cached{{dtype=\"bf16\"}} {}\n", s.kv.cached.bf16);
    o += fmt::format("oscar_kv_pages_cached{{dtype=\"quant\"}} {}\n", s.kv.cached.quant);
    metric("oscar_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.");
    line("oscar_prefix_cache_queries_total", double(m.prefix_queries));
    metric("oscar_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache (not recomputed).");
    line("oscar_prefix_cache_hits_total", double(m.prefix_hits));
    metric("oscar_prefix_waits_total", "counter",
           "Admissions put off because a running sequence was computing the request's first full pages.");
    line("oscar_prefix_waits_total", double(m.prefix_waits));
    metric("oscar_prefix_cache_hit_rate", "gauge", "prefix_cache_hits_total / prefix_cache_queries_total.");
    line("oscar_prefix_cache_hit_rate", m.prefix_queries ? double(m.prefix_hits) / m.prefix_queries : 0.0);
    metric("oscar_kv_tokens", "gauge", "Cached tokens of live sequences, by region (sink and recent: BF16; middle: quantized).");
    o += fmt::format("oscar_kv_tokens{{region=\"sink\"}} {}\n", s.kv.sink_tokens);
    o += fmt::format("oscar_kv_tokens{{region=\"middle\"}} {}\n", s.kv.mid_tokens);
    o += fmt::format("oscar_kv_tokens{{region=\"recent\"}} {}\n", s.kv.recent_tokens);
    metric("oscar_kv_sequences", "gauge", "Sequences holding KV pages.");
    line("oscar_kv_sequences", s.kv.sequences);
    metric("oscar_prompt_tokens_total", "counter", "Prompt tokens of finished requests.");
    line("oscar_prompt_tokens_total", double(m.prompt_tokens));
    metric("oscar_generation_tokens_total", "counter", "Tokens generated.");
    line("oscar_generation_tokens_total", double(m.generation_tokens));
    metric("oscar_prefill_tokens_total", "counter", "Tokens run as prefill (recomputation after preemption included).");
    line("oscar_prefill_tokens_total", double(m.prefill_tokens));
    metric("oscar_host_draws_total", "counter",
           "Tokens drawn on the host from copied logits (the CPU backend's sampled rows; on a GPU only rows "
           "too flat for the device).");
    line("oscar_host_draws_total", double(m.host_draws));
    metric("oscar_preemptions_total", "counter", "Sequences preempted for lack of KV pages.");
    line("oscar_preemptions_total", double(m.preemptions));
    metric("oscar_engine_steps_total", "counter", "Forward steps.");
    line("oscar_engine_steps_total", double(m.steps));
    metric("oscar_engine_busy_seconds_total", "counter", "Time spent in forward steps.");
    line("oscar_engine_busy_seconds_total", m.busy_s);
    metric("oscar_request_success_total", "counter", "Finished requests by finish reason.");
    o += fmt::format("oscar_request_success_total{{finished_reason=\"stop\"}} {}\n", m.finished_stop);
    o += fmt::format("oscar_request_success_total{{finished_reason=\"length\"}} {}\n", m.finished_length);
    o += fmt::format("oscar_request_success_total{{finished_reason=\"abort\"}} {}\n", m.finished_abort);
    o += fmt::format("oscar_request_success_total{{finished_reason=\"error\"}} {}\n", m.finished_error);
    metric("oscar_requests_rejected_total", "counter", "Requests refused by the scheduler (invalid or queue full).");
    line("oscar_requests_rejected_total", double(m.requests_rejected));
    metric("oscar_http_errors_total", "counter", "HTTP error responses of the completion endpoints.");
    o += fmt::format("oscar_http_errors_total{{class=\"4xx\"}} {}\n", http_errors_4xx.load());
    o += fmt::format("oscar_http_errors_total{{class=\"5xx\"}} {}\n", http_errors_5xx.load());
    {
      // Generation throughput since the previous scrape (or start).
      std::lock_guard lk(rate_mu);
      const auto now = std::chrono::steady_clock::now();
      const double dt = std::chrono::duration<double>(now - rate_t).count();
      if (dt >= 0.5) {
        rate = (m.generation_tokens - rate_tokens) / dt;
        rate_t = now;
        rate_tokens = m.generation_tokens;
      }
      metric("oscar_generation_tokens_per_second", "gauge", "Generated tokens per second since the previous scrape.");
      line("oscar_generation_tokens_per_second", rate);
    }
    hist("oscar_time_to_first_token_seconds", "Time from arrival to the first generated token.", m.ttft);
    hist("oscar_time_per_output_token_seconds", "Mean time between tokens of a finished request.", m.tpot);
    hist("oscar_inter_token_latency_seconds", "Time between successive tokens.", m.itl);
    hist("oscar_e2e_request_latency_seconds", "Time from arrival to the last token.", m.e2e);
    hist("oscar_request_queue_time_seconds", "Time from arrival to the first admission.", m.queue);
    hist("oscar_decode_step_seconds", "Forward steps whose rows are all decode tokens.", m.decode_step);
    hist("oscar_mixed_step_seconds", "Forward steps with a prompt chunk (and any decode rows).", m.mixed_step);
    return o;
  }
};

Server::Server(engine::AsyncEngine& engine, const engine::Scheduler& sched,
               const model::Tokenizer& tok, ServerOptions opts)
    : impl_(std::make_unique<Impl>(engine, sched, tok, std::move(opts))) {
  Impl& I = *impl_;
  auto& http = I.http;
  const int threads = I.opts.http_threads > 0 ? I.opts.http_threads
                                              : 2 * sched.config().max_running + 8;
  http.new_task_queue = [threads] { return new httplib::ThreadPool(size_t(threads)); };
  // The library listens with a backlog of 5: a burst of clients connecting at
  // once gets connections reset. Remember the socket and listen again on it
  // with a deep queue after bind (Linux updates the backlog of a listening socket).
  http.set_socket_options([&I](socket_t sock) {
    httplib::default_socket_options(sock);
    I.listen_fd = static_cast<int>(sock);
  });
  http.set_payload_max_length(I.opts.max_body_bytes);
  http.set_read_timeout(30, 0);
  http.set_write_timeout(30, 0);
  http.set_keep_alive_max_count(1000);

  http.Post("/v1/completions", [&I](const httplib::Request& q, httplib::Response& r) {
    I.completions(q, r, false);
  });
  http.Post("/v1/chat/completions", [&I](const httplib::Request& q, httplib::Response& r) {
    I.completions(q, r, true);
  });
  http.Post("/tokenize", [&I](const httplib::Request& q, httplib::Response& r) { I.tokenize(q, r, false); });
  http.Post("/detokenize", [&I](const httplib::Request& q, httplib::Response& r) { I.tokenize(q, r, true); });
  http.Get("/v1/models", [&I](const httplib::Request& q, httplib::Response& r) {
    try {
      I.check_auth(q);
      json m = {{"id", I.opts.model_name},
                {"object", "model"},
                {"created", unix_now()},
                {"owned_by", "oscar"},
                {"max_model_len", I.sched.config().max_model_len},
                {"kv_cache", I.sched.cache().method()}};
      r.set_content(dump_json({{"object", "list"}, {"data", json::array({m})}}), "application/json");
    } catch (const ApiError& e) {
      send_error(r, e);
    }
  });
  http.Get("/health", [&I](const httplib::Request&, httplib::Response& r) {
    if (I.stopping) {
      r.status = 503;
      r.set_content(R"({"status":"shutting down"})", "application/json");
    } else {
      r.set_content(R"({"status":"ok"})", "application/json");
    }
  });
  http.Get("/metrics", [&I](const httplib::Request&, httplib::Response& r) {
    r.set_content(I.metrics_text(), "text/plain; version=0.0.4");
  });
  // Errors the library produces itself (unknown route, body too large, ...) in
  // the same JSON shape.
  http.set_error_handler([](const httplib::Request& q, httplib::Response& r) {
    if (!r.body.empty()) return;
    const std::string msg =
        r.status == 404   ? fmt::format("no route {} {}", q.method, q.path)
        : r.status == 413 ? std::string("the request body is too large")
                          : fmt::format("HTTP {}", r.status);
    r.set_content(dump_json(ApiError(r.status, msg, r.status >= 500 ? "server_error"
                                                                    : "invalid_request_error")
                                .body()),
                  "application/json");
  });
}

Server::~Server() = default;

void Server::bind() {
  if (impl_->opts.port == 0) {
    port_ = impl_->http.bind_to_any_port(impl_->opts.host);
    if (port_ <= 0) throw Error(fmt::format("serve: cannot bind {}", impl_->opts.host));
  } else {
    if (!impl_->http.bind_to_port(impl_->opts.host, impl_->opts.port))
      throw Error(fmt::format("serve: cannot bind {}:{} (in use?)", impl_->opts.host,
                              impl_->opts.port));
    port_ = impl_->opts.port;
  }
  if (impl_->listen_fd >= 0 && ::listen(impl_->listen_fd, 1024) != 0)
    throw Error(fmt::format("serve: cannot listen on {}:{}", impl_->opts.host, port_));
}

void Server::listen() { impl_->http.listen_after_bind(); }

void Server::stop() {
  impl_->stopping = true;
  impl_->engine.shutdown(/*drain=*/true);  // finishes what runs and waits
  impl_->http.stop();
}

std::string Server::metrics_text() { return impl_->metrics_text(); }

}  // namespace oscar::serve
