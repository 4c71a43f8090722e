// safetensors files (Hugging Face checkpoints, calibration files, activation
// dumps all use it): header length, JSON header, dtypes, shapes, offsets,
// overlaps; every float tensor is converted.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "core/safetensors.h"
#include "fuzz_util.h"

using namespace oscar;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::write_input(data, size, "input.safetensors");
  try {
    st::File f = st::File::open(path);
    (void)f.meta("format");
    for (const std::string& name : f.names()) {
      const st::TensorInfo& t = f.at(name);
      switch (t.dtype) {
        case st::Dtype::F64: case st::Dtype::F32: case st::Dtype::F16: case st::Dtype::BF16:
          (void)f.read_f32(name);
          break;
        default:
          (void)f.data(t);
      }
    }
  } catch (const Error&) {
  }
  return 0;
}
