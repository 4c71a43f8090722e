// GGUF (llama.cpp's model file format, versions 2 and 3): a memory-mapped
// reader for the header, the metadata key/values (all value types, arrays
// included) and the tensor infos, plus dequantization of the tensor types
// DESIGN §4 names to fp32.
//
// File layout (little endian):
//   "GGUF" u32 version, u64 n_tensors, u64 n_kv,
//   n_kv x { string key, u32 value_type, value },
//   n_tensors x { string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset },
//   padding to `general.alignment` (default 32), then the data section; each
//   tensor's offset is relative to the data section start and aligned too.
//   A string is u64 length + bytes (no terminator). ne[0] is the innermost
//   (contiguous) dimension; TensorInfo::shape lists dimensions outermost first.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace oscar::model::gguf {

enum class ValueType : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7,
  kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};

// ggml tensor types (the numbering is the file format's).
enum class GgmlType : uint32_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ8_1 = 9,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kQ8_K = 15,
  kI8 = 24, kI16 = 25, kI32 = 26, kI64 = 27, kF64 = 28, kBF16 = 30,
};

const char* type_name(GgmlType t);
// Elements per block and bytes per block; {0, 0} for a type we do not know.
struct BlockLayout { int64_t elems; int64_t bytes; };
BlockLayout block_layout(GgmlType t);
// True when dequantize() handles the type.
bool can_dequantize(GgmlType t);

// One metadata value. Scalars live in the field of their kind (integers of
// every width in `i` (signed) / `u` (unsigned), floats in `f`); arrays keep
// their element type in `array_type` and the elements in `strs`, `ints` (all
// integer and bool kinds) or `floats`.
struct Value {
  ValueType type = ValueType::kU8;
  ValueType array_type = ValueType::kU8;
  int64_t i = 0;
  uint64_t u = 0;
  double f = 0.0;
  bool b = false;
  std::string str;
  std::vector<std::string> strs;
  std::vector<int64_t> ints;
  std::vector<double> floats;

  bool is_array() const { return type == ValueType::kArray; }
  bool is_integer() const;
  bool is_float() const { return type == ValueType::kF32 || type == ValueType::kF64; }
  size_t array_size() const;
};

struct TensorInfo {
  std::string name;
  GgmlType type = GgmlType::kF32;
  std::vector<int64_t> shape;  // outermost first (reverse of ggml's ne[])
  uint64_t offset = 0;         // absolute file offset of the data
  uint64_t nbytes = 0;
  int64_t numel() const;
};

class File {
 public:
  // Maps the file read-only and parses everything but the tensor data.
  // Throws oscar::Error naming the path on any malformed content.
  static File open(const std::string& path);

  File(File&&) noexcept;
  File& operator=(File&&) noexcept;
  ~File();

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  const std::map<std::string, Value>& metadata() const { return kv_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }

  const Value* find_kv(const std::string& key) const;
  // Typed getters: throw naming the file and key when absent or of the wrong kind.
  std::string get_string(const std::string& key) const;
  int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;  // accepts integers too
  // Defaults when the key is absent (still throws on a wrong kind).
  std::string get_string(const std::string& key, const std::string& dflt) const;
  int64_t get_int(const std::string& key, int64_t dflt) const;
  double get_float(const std::string& key, double dflt) const;
  bool get_bool(const std::string& key, bool dflt) const;

  const TensorInfo* find(const std::string& name) const;
  const TensorInfo& at(const std::string& name) const;  // throws when absent
  const std::byte* data(const TensorInfo& t) const;     // raw block bytes

  // The tensor dequantized to fp32, row-major in TensorInfo::shape.
  std::vector<float> read_f32(const TensorInfo& t) const;
  std::vector<float> read_f32(const std::string& name) const { return read_f32(at(name)); }

 private:
  File() = default;
  std::string path_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  std::map<std::string, Value> kv_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> by_name_;
  struct Mapping;
  std::unique_ptr<Mapping> map_;
};

// Dequantizes `n` elements (a whole number of blocks) of type `t` from `src`
// into `dst`. Throws oscar::Error for types without a dequantizer.
void dequantize(GgmlType t, const std::byte* src, float* dst, int64_t n);

}  // namespace oscar::model::gguf
