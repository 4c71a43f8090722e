// safetensors reader (memory-mapped, read-only) and writer.
//
// Format (huggingface/safetensors): 8-byte little-endian header length N, then N
// bytes of JSON {"__metadata__": {str: str}, name: {"dtype", "shape",
// "data_offsets": [begin, end]}}, then the data block; offsets are relative to
// the start of the data block. Used for calibration files and activation dumps
// (DESIGN §9) and for Hugging Face checkpoints.
//
// The reader validates everything before handing out a pointer: header length
// vs file size, JSON syntax, dtype names, shapes, offsets in range, byte length
// == numel * dtype_size, no overlapping tensors. Any violation is an
// oscar::Error naming the file and the problem.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace oscar::st {

enum class Dtype { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL };

size_t dtype_size(Dtype);
const char* dtype_name(Dtype);  // "F32", "BF16", ... (the file's spelling)

struct TensorInfo {
  std::string name;
  Dtype dtype;
  std::vector<int64_t> shape;
  uint64_t begin, end;  // byte offsets relative to the data block
  int64_t numel() const;
};

class File {  // move-only; mmap of the whole file
 public:
  static File open(const std::string& path);  // throws oscar::Error naming path + problem
  File(File&&) noexcept;
  File& operator=(File&&) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Value of a metadata key or `fallback` when absent.
  std::string meta(const std::string& key, const std::string& fallback = "") const;
  const TensorInfo* find(const std::string& name) const;       // nullptr if absent
  const TensorInfo& at(const std::string& name) const;         // throws if absent
  std::vector<std::string> names() const;                      // sorted
  const std::byte* data(const TensorInfo&) const;              // pointer into the mapping
  std::vector<float> read_f32(const std::string& name) const;  // converts F64/F32/F16/BF16
  // Converts elements [first, first+count) of a float tensor into out[count].
  void read_f32_range(const TensorInfo& t, int64_t first, int64_t count, float* out) const;
  const std::string& path() const { return path_; }
  uint64_t file_size() const { return size_; }

 private:
  File() = default;
  std::string path_;
  void* map_ = nullptr;
  uint64_t size_ = 0;
  const std::byte* data_block_ = nullptr;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, TensorInfo> tensors_;
};

class Writer {
 public:
  void add(const std::string& name, Dtype, std::vector<int64_t> shape, const void* bytes,
           size_t nbytes);
  void add_f32(const std::string& name, std::vector<int64_t> shape, const float* data);
  void set_metadata(const std::string& key, const std::string& value);
  void write(const std::string& path) const;  // atomic: write tmp file then rename

 private:
  struct Entry {
    std::string name;
    Dtype dtype;
    std::vector<int64_t> shape;
    std::vector<std::byte> bytes;
  };
  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Streams a large file without holding it in memory: the header is written
// up front from the declared tensors (data laid out in declaration order),
// then each tensor's bytes are appended in that order. finish() checks that
// exactly the declared bytes arrived and renames the tmp file into place;
// destroying an unfinished writer removes the tmp file.
class StreamWriter {
 public:
  struct Decl {
    std::string name;
    Dtype dtype;
    std::vector<int64_t> shape;
  };
  StreamWriter(const std::string& path, const std::vector<Decl>& tensors,
               const std::map<std::string, std::string>& metadata);
  ~StreamWriter();
  StreamWriter(const StreamWriter&) = delete;
  StreamWriter& operator=(const StreamWriter&) = delete;
  void append(const void* bytes, size_t n);
  void finish();

 private:
  std::string path_, tmp_;
  void* fp_ = nullptr;
  uint64_t expected_ = 0, written_ = 0;
};

// Elementwise conversion of `count` elements of a float dtype to fp32.
void convert_to_f32(Dtype dt, const std::byte* src, int64_t count, float* out);

}  // namespace oscar::st
