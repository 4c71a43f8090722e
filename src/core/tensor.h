// A dense fp32 tensor on the host: what loaders produce and backends prepare.
#pragma once

#include <cstdint>
#include <vector>

namespace oscar {

struct Tensor {
  std::vector<int64_t> shape;  // outermost first
  std::vector<float> data;     // row-major
  bool empty() const { return data.empty(); }
  int64_t numel() const { return static_cast<int64_t>(data.size()); }
};

}  // namespace oscar
