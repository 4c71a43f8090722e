// OSCAR calibration files: metadata, per-layer rotations / spectra / clips /
// key transform, validation (orthogonality, finiteness, ranges), then the
// fingerprint check against a model of the same and of another shape.
#include <cstddef>
#include <cstdint>

#include "core/calibration.h"
#include "core/error.h"
#include "fuzz_util.h"

using namespace oscar;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::write_input(data, size, "input.calib.safetensors");
  Calibration c;
  try {
    c = read_calibration(path);
  } catch (const Error&) {
    return 0;
  }
  ModelFingerprint same = c.model;
  try {
    check_calibration_matches(c, same, path);
  } catch (const Error&) {
    __builtin_trap();  // a file that was read must match its own fingerprint
  }
  ModelFingerprint other = same;
  other.head_dim = same.head_dim == 64 ? 128 : 64;
  try {
    check_calibration_matches(c, other, path);
    __builtin_trap();  // another head_dim must be refused
  } catch (const Error&) {
  }
  for (const LayerCalibration& L : c.layers)
    for (int h = 0; h < c.model.n_kv_heads; ++h) (void)(L.k_clip_of(h) + L.v_clip_of(h));
  return 0;
}
