#include "core/parallel.h"

#include <cstdlib>

namespace oscar {

int default_threads() {
  static const int n = [] {
    if (const char* e = std::getenv("OSCAR_NUM_THREADS")) {
      const int v = std::atoi(e);
      if (v > 0) return v;
    }
    const unsigned hc = std::thread::hardware_concurrency();
    return hc > 0 ? static_cast<int>(hc) : 1;
  }();
  return n;
}

}  // namespace oscar
