// The KV cache methods of DESIGN §6.1, selected by name, all through the same
// cache code (kv/oscar_cache.h) except bf16 (kv/bf16_cache.h). kivi2 is the
// OSCAR cache with per-channel keys (paged_kv.h KeyAxis::kChannel): the engine
// decodes from it token by token like the others, and the evaluation's
// prefill simulation (eval/eval.h) follows the same page-granular rule.
//
//   bf16            every token BF16
//   int2-naive      no rotation, no clipping, same windows
//   int2-hadamard   R = H for keys and values (QuaRot-style), clips 0.96 / 0.92
//   int4-hadamard   as int2-hadamard at 4 bits, no clipping (4-bit reference)
//   kivi2           KIVI-2: keys per channel over groups of 32 tokens (2-bit
//                   codes, fp16 scale/min per channel per 32-token span), values
//                   per token in groups of 32 channels (fp16 scale/min), a BF16
//                   residual window of the newest 128..128+page-1 tokens, no
//                   sink, no rotation, no clipping. Demotion is page-granular
//                   like the others (page size a multiple of 32); the middle
//                   costs 3 bits per element (K: 2 + 32/32, V: 2 + 32/32).
//   oscar           the calibration file as it is (normally U·H·P)
//   oscar-U, oscar-UH, oscar-UHP   ablations: the same eigenvectors composed
//                   differently (derived from the file's rotation and eigenvalues)
//   oscar-noclip    the file's rotations, clipping off
//   int2-raw-pca    needs a calibration made with raw KᵀK / VᵀV targets
//   NAME=FILE       any of the calibrated names with its own calibration file
//                   (value targets, granularity, clip search are file properties);
//                   the label becomes NAME@<file stem>.
//   NAME+clipK/V    modifiers of a row method: every clip ratio set to K (keys)
//   NAME+gN         and V (values); quantization group N (32, 64, 128);
//   NAME+bf16LIST   the listed layers' K/V kept in BF16, LIST of layer numbers
//                   and ranges joined by '.', e.g. +bf16L0-3.27 (the evaluation's
//                   simulation only, for finding where the error lives: the
//                   caches refuse it; bits per element count those layers at 16).
//                   e.g. oscar+clip0.92/0.88, int2-hadamard+g32
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/calibration.h"
#include "kv/kv_cache.h"

namespace oscar::kv {

struct KvMethod {
  enum class Kind { kBf16, kRow, kKivi };
  std::string label;
  Kind kind = Kind::kBf16;
  std::shared_ptr<const Calibration> calib;  // kRow, kKivi (identity): rotations and clips per layer
  int bits = 2;
  int group_size = 128;  // channels per (scale, min) group (clamped to head_dim)
  int sink = 64, recent = 256;
  // Prompts read their own earlier chunks in BF16; demotion waits for the first decode step
  // (OscarCacheOptions::prompt_bf16). The teacher-forced engine evaluation turns it off.
  bool prompt_bf16 = true;
  // +bf16L: layers whose K/V stay BF16 (sorted; the evaluation's simulation only).
  std::vector<int> bf16_layers;
  bool bf16_layer(int layer) const;
  // kRow with a non-identity value rotation: W_v / W_o must be folded.
  bool folds_values() const;
  // DESIGN §5.4 for a sequence of T tokens under page-granular demotion
  // (the middle holds the whole pages of [sink, T - recent); every byte
  // counted: codes, params, BF16 windows; kivi2's keys have per-channel params).
  double bits_per_element(int64_t T, int head_dim, int page_size) const;
};

struct KvMethodOptions {
  std::string calib_path;  // the default calibration file for calibrated names
  ModelFingerprint model;  // calibrations are checked against it
  std::vector<float> rope_freq;  // the model's RoPE frequencies: page centering is checked against them
  int sink = 64, recent = 256;
  int group_size = 128;
};

// Resolves one method name (see above). Throws oscar::Error for an unknown
// name, a calibrated name without a calibration file, or a calibration that
// does not match the model.
KvMethod resolve_kv_method(const std::string& spec, const KvMethodOptions& opts);
// Comma-separated list.
std::vector<KvMethod> resolve_kv_methods(const std::string& list, const KvMethodOptions& opts);
std::vector<std::string> kv_method_names();

// A cache for a method. max_tokens: page budget. Throws oscar::Error for
// kivi2 with a page size that is not a multiple of 32.
std::unique_ptr<KvCache> make_method_cache(const KvMethod& m, const KvCacheShape& shape,
                                           int64_t max_tokens, bool prefix_caching = false,
                                           const backend::PageStoreFactory& store = {});

// Bytes of one page over every layer, K and V: BF16 (sink / recent, or every
// token of the bf16 method) and the method's quantized middle page (codes and
// fp16 params). quant_page_bytes is 0 for bf16.
int64_t bf16_page_bytes(const KvCacheShape& shape);
int64_t quant_page_bytes(const KvMethod& m, const KvCacheShape& shape);

// A cache sized by memory: `bytes` of pages in all. BF16 gets every page for
// the bf16 method; a quantized method gets enough BF16 pages for `sequences`
// sequences' sink and recent windows plus `chunk` prefill tokens, the rest as
// quantized pages. Throws oscar::Error when the budget cannot hold that.
std::unique_ptr<KvCache> make_method_cache_for_bytes(const KvMethod& m, const KvCacheShape& shape,
                                                     int64_t bytes, int sequences, int chunk,
                                                     bool prefix_caching = false,
                                                     const backend::PageStoreFactory& store = {});

// The most sequences of `tokens` tokens each (their decode steps included) that a cache of
// `bytes` holds, sized as make_method_cache_for_bytes sizes it for that many sequences and
// `chunk` prefill tokens: every page BF16 for bf16; for a quantized method each sequence's
// sink and recent window in BF16 and its middle pages quantized. (The equal-memory
// comparison of `oscar bench`.)
int sequences_for_bytes(const KvMethod& m, const KvCacheShape& shape, int64_t bytes, int64_t tokens, int chunk);
// The inverse, to within 1 MiB: the least bytes for which sequences_for_bytes gives at least
// `sequences` (>= 1): a cache sized for a batch (the equal-batch rows of the benchmarks).
int64_t bytes_for_sequences(const KvMethod& m, const KvCacheShape& shape, int sequences, int64_t tokens, int chunk);

// A calibration with the same eigenvectors recomposed as `target` (U, UH or
// UHP), from one composed as U, UH or UHP with eigenvalues stored.
Calibration recompose(const Calibration& c, Composition target);

}  // namespace oscar::kv
