#include "engine/generator.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "engine/step_draw.h"

namespace oscar::engine {

std::string StopStringMatcher::push(std::string_view text) {
  if (stopped_) return {};
  pending_.append(text);
  // Earliest complete stop string wins.
  size_t cut = std::string::npos;
  for (const auto& s : stops_) {
    if (s.empty()) continue;
    size_t p = pending_.find(s);
    if (p != std::string::npos) cut = std::min(cut, p);
  }
  if (cut != std::string::npos) {
    stopped_ = true;
    std::string out = pending_.substr(0, cut);
    pending_.clear();
    return out;
  }
  // Keep the longest suffix that is a proper prefix of some stop string.
  size_t hold = 0;
  for (const auto& s : stops_)
    for (size_t k = std::min(s.size() - (s.empty() ? 0 : 1), pending_.size()); k > hold; --k)
      if (pending_.compare(pending_.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string StopStringMatcher::flush() {
  std::string out;
  out.swap(pending_);
  return out;
}

Generator::Generator(model::Model& m, kv::KvCache& cache, TokenText token_text, int prefill_chunk)
    : m_(m), cache_(cache), token_text_(std::move(token_text)),
      prefill_chunk_(std::max(1, prefill_chunk)) {}

namespace {
using Clock = std::chrono::steady_clock;
double secs(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}
}  // namespace

std::vector<Result> Generator::run(std::span<const Request> reqs, const OnText& on_text) {
  const int N = static_cast<int>(reqs.size());
  const int V = m_.config().vocab_size;
  stats_ = Stats{};
  for (int i = 0; i < N; ++i) {
    const Request& r = reqs[i];
    if (r.prompt.empty()) throw Error(fmt::format("generate: request {} has an empty prompt", i));
    for (int t : r.prompt)
      if (t < 0 || t >= V)
        throw Error(fmt::format("generate: request {}: token {} outside vocabulary [0, {})", i, t, V));
    if (r.max_new_tokens < 0)
      throw Error(fmt::format("generate: request {}: negative max_new_tokens", i));
    if (!r.stop_strings.empty() && !token_text_)
      throw Error("generate: stop strings need a tokenizer");
    r.sampling.validate();
  }

  struct Live {
    kv::SeqId seq;
    Sampler sampler;
    StopStringMatcher stop;
    std::vector<int> history;  // prompt + generated
    int fed = 0;               // prompt tokens prefilled
    bool done = false;
  };
  std::vector<Live> live;
  std::vector<Result> out(N);
  live.reserve(N);
  for (int i = 0; i < N; ++i)
    live.push_back({cache_.create(), Sampler(reqs[i].sampling, static_cast<int>(reqs[i].prompt.size())), StopStringMatcher(reqs[i].stop_strings),
                    reqs[i].prompt, 0, false});

  auto emit = [&](int i, const std::string& s) {
    if (s.empty()) return;
    out[i].text += s;
    if (on_text) on_text(i, s);
  };
  // Records a sampled token; false when the request is finished.
  auto accept = [&](int i, int tok) {
    Live& L = live[i];
    const Request& r = reqs[i];
    out[i].tokens.push_back(tok);
    L.history.push_back(tok);
    ++stats_.generated_tokens;
    if (std::find(r.stop_tokens.begin(), r.stop_tokens.end(), tok) != r.stop_tokens.end()) {
      out[i].finish_reason = "stop";
    } else {
      if (token_text_) emit(i, L.stop.push(token_text_(tok)));
      if (L.stop.stopped()) out[i].finish_reason = "stop";
      else if (int(out[i].tokens.size()) >= r.max_new_tokens) out[i].finish_reason = "length";
    }
    if (out[i].finish_reason.empty()) return true;
    emit(i, L.stop.flush());
    L.done = true;
    cache_.release(L.seq);
    return false;
  };

  try {
    // Prefill: every prompt, chunked, several sequences per call.
    const auto t0 = Clock::now();
    // The step's tokens (StepDrawer): one job per row `rows` (positions in `who`); a row
    // that cannot be drawn throws.
    StepDrawer drawer;
    std::vector<SampleJob> jobs;
    auto step = [&](const std::vector<model::SeqStep>& steps, const std::vector<int>& who,
                    const std::vector<size_t>& rows) {
      jobs.assign(rows.size(), {});
      for (size_t k = 0; k < rows.size(); ++k) {
        Live& L = live[who[rows[k]]];
        jobs[k].sampler = &L.sampler;
        jobs[k].history = L.history;
        jobs[k].row = static_cast<int>(rows[k]);
        jobs[k].appends = true;  // a request's history only grows
      }
      drawer.run(m_, steps, cache_, jobs);
      for (const SampleJob& j : jobs)
        if (j.token < 0) throw Error("generate: sampling failed: " + j.error);
    };
    std::vector<std::vector<int32_t>> chunk(N);
    for (;;) {
      std::vector<model::SeqStep> steps;
      std::vector<int> who;
      int budget = prefill_chunk_;
      for (int i = 0; i < N && budget > 0; ++i) {
        Live& L = live[i];
        const int left = int(reqs[i].prompt.size()) - L.fed;
        if (left == 0) continue;
        const int n = std::min(left, budget);
        chunk[i].assign(reqs[i].prompt.begin() + L.fed, reqs[i].prompt.begin() + L.fed + n);
        steps.push_back({L.seq, chunk[i], false});
        who.push_back(i);
        L.fed += n;
        budget -= n;
      }
      if (steps.empty()) break;
      std::vector<size_t> rows;  // the sequences whose prompt this step ends
      for (size_t s = 0; s < who.size(); ++s) {
        const int i = who[s];
        if (live[i].fed == int(reqs[i].prompt.size()) && reqs[i].max_new_tokens != 0) rows.push_back(s);
      }
      step(steps, who, rows);
      for (size_t s = 0; s < who.size(); ++s) {
        const int i = who[s];
        if (live[i].fed == int(reqs[i].prompt.size()) && reqs[i].max_new_tokens == 0) {
          out[i].finish_reason = "length";
          live[i].done = true;
          cache_.release(live[i].seq);
        }
      }
      for (size_t k = 0; k < rows.size(); ++k) accept(who[rows[k]], jobs[k].token);
    }
    const auto t1 = Clock::now();
    for (const auto& r : reqs) stats_.prompt_tokens += int(r.prompt.size());
    stats_.prefill_s = secs(t0, t1);

    // Decode: one token per live sequence per call.
    std::vector<int32_t> last(N);
    for (;;) {
      std::vector<model::SeqStep> steps;
      std::vector<int> who;
      for (int i = 0; i < N; ++i) {
        if (live[i].done) continue;
        last[i] = live[i].history.back();
        steps.push_back({live[i].seq, {&last[i], 1}, false});
        who.push_back(i);
      }
      if (steps.empty()) break;
      std::vector<size_t> rows(who.size());
      for (size_t s = 0; s < who.size(); ++s) rows[s] = s;
      step(steps, who, rows);
      for (size_t s = 0; s < who.size(); ++s) {
        ++stats_.decode_tokens;
        accept(who[s], jobs[s].token);
      }
    }
    stats_.decode_s = secs(t1, Clock::now());
  } catch (...) {
    for (auto& L : live)
      if (!L.done) cache_.release(L.seq);
    throw;
  }
  return out;
}

}  // namespace oscar::engine
