// Activation dumps written by any framework (DESIGN §9): layer numbering,
// shapes that must agree, dtypes; then every layer's q/k/v(/o) is read in
// chunks as calibration reads them.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/activation_dump.h"
#include "core/error.h"
#include "fuzz_util.h"

using namespace oscar;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::write_input(data, size, "input.dump.safetensors");
  try {
    ActivationDump d = ActivationDump::open(path);
    (void)d.fingerprint();
    const int64_t T = d.tokens(), chunk = 7;
    std::vector<float> buf;
    for (int l = 0; l < d.n_layers(); ++l) {
      for (char which : {'q', 'k', 'v', 'o'}) {
        if (which == 'o' && !d.has_o()) continue;
        const int heads = (which == 'q' || which == 'o') ? d.n_q_heads() : d.n_kv_heads();
        for (int64_t t0 = 0; t0 < T; t0 += chunk) {
          const int64_t n = T - t0 < chunk ? T - t0 : chunk;
          buf.resize(static_cast<size_t>(n * heads * d.head_dim()));
          d.read(l, which, t0, n, buf.data());
        }
      }
    }
  } catch (const Error&) {
  }
  return 0;
}
