// A cumulative histogram in the Prometheus sense: fixed upper bounds, counts of
// observations <= each bound, their sum and count.
#pragma once

#include <cstdint>
#include <vector>

namespace oscar::engine {

struct Histogram {
  explicit Histogram(std::vector<double> bounds) : le(std::move(bounds)), counts(le.size(), 0) {}
  void observe(double x) {
    for (size_t i = 0; i < le.size(); ++i)
      if (x <= le[i]) ++counts[i];
    sum += x;
    ++count;
  }
  // Seconds: token latencies (TTFT, TPOT, ITL) and whole requests.
  static std::vector<double> latency_buckets() {
    return {0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25,
            0.5,   0.75,   1.0,   2.5,  5.0,  7.5,  10.0, 20.0, 40.0, 80.0};
  }
  static std::vector<double> e2e_buckets() {
    return {0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0};
  }

  std::vector<double> le;       // upper bounds (+Inf implied)
  std::vector<int64_t> counts;  // cumulative: observations <= le[i]
  double sum = 0;
  int64_t count = 0;
};

}  // namespace oscar::engine
