// GGUF parsing over a read-only memory map. Every read is bounds-checked
// against the file size so a truncated or corrupt file is an oscar::Error
// naming the file, never a crash.
#include "model/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <algorithm>
#include <limits>
#include <thread>

#include <fmt/format.h>

#include "core/error.h"

namespace oscar::model::gguf {

struct File::Mapping {
  const std::byte* base = nullptr;
  size_t size = 0;
  ~Mapping() {
    if (base != nullptr && size > 0) munmap(const_cast<std::byte*>(base), size);
  }
};

File::File(File&&) noexcept = default;
File& File::operator=(File&&) noexcept = default;
File::~File() = default;

bool Value::is_integer() const {
  switch (type) {
    case ValueType::kU8: case ValueType::kI8: case ValueType::kU16: case ValueType::kI16:
    case ValueType::kU32: case ValueType::kI32: case ValueType::kU64: case ValueType::kI64:
      return true;
    default:
      return false;
  }
}

size_t Value::array_size() const {
  if (!is_array()) return 0;
  if (array_type == ValueType::kString) return strs.size();
  if (array_type == ValueType::kF32 || array_type == ValueType::kF64) return floats.size();
  return ints.size();
}

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

// Sequential little-endian reader with bounds checks.
class Cursor {
 public:
  Cursor(const std::string& path, const std::byte* base, size_t size)
      : path_(path), base_(base), size_(size) {}

  size_t pos() const { return pos_; }
  void need(size_t n, const char* what) const {
    if (n > size_ - pos_)
      throw Error(fmt::format("{}: truncated file: {} needs {} bytes at offset {}, file has {}",
                              path_, what, n, pos_, size_));
  }
  template <typename T>
  T read(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, base_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string read_string(const char* what) {
    const uint64_t n = read<uint64_t>(what);
    if (n > size_ - pos_)
      throw Error(fmt::format("{}: truncated file: {} of {} bytes at offset {}, file has {}", path_,
                              what, n, pos_, size_));
    std::string s(reinterpret_cast<const char*>(base_ + pos_), static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return s;
  }

 private:
  const std::string& path_;
  const std::byte* base_;
  size_t size_;
  size_t pos_ = 0;
};

const char* value_type_name(ValueType t) {
  switch (t) {
    case ValueType::kU8: return "u8";
    case ValueType::kI8: return "i8";
    case ValueType::kU16: return "u16";
    case ValueType::kI16: return "i16";
    case ValueType::kU32: return "u32";
    case ValueType::kI32: return "i32";
    case ValueType::kF32: return "f32";
    case ValueType::kBool: return "bool";
    case ValueType::kString: return "string";
    case ValueType::kArray: return "array";
    case ValueType::kU64: return "u64";
    case ValueType::kI64: return "i64";
    case ValueType::kF64: return "f64";
  }
  return "unknown";
}

bool valid_value_type(uint32_t t) { return t <= 12; }

// Reads one scalar of type t into v (v.type is set by the caller).
void read_scalar(Cursor& c, ValueType t, Value& v, const char* what) {
  switch (t) {
    case ValueType::kU8: v.u = c.read<uint8_t>(what); v.i = static_cast<int64_t>(v.u); break;
    case ValueType::kI8: v.i = c.read<int8_t>(what); v.u = static_cast<uint64_t>(v.i); break;
    case ValueType::kU16: v.u = c.read<uint16_t>(what); v.i = static_cast<int64_t>(v.u); break;
    case ValueType::kI16: v.i = c.read<int16_t>(what); v.u = static_cast<uint64_t>(v.i); break;
    case ValueType::kU32: v.u = c.read<uint32_t>(what); v.i = static_cast<int64_t>(v.u); break;
    case ValueType::kI32: v.i = c.read<int32_t>(what); v.u = static_cast<uint64_t>(v.i); break;
    case ValueType::kU64: v.u = c.read<uint64_t>(what); v.i = static_cast<int64_t>(v.u); break;
    case ValueType::kI64: v.i = c.read<int64_t>(what); v.u = static_cast<uint64_t>(v.i); break;
    case ValueType::kF32: v.f = c.read<float>(what); break;
    case ValueType::kF64: v.f = c.read<double>(what); break;
    case ValueType::kBool: v.b = c.read<uint8_t>(what) != 0; v.i = v.b ? 1 : 0; v.u = v.b ? 1 : 0; break;
    case ValueType::kString: v.str = c.read_string(what); break;
    case ValueType::kArray: break;  // handled by the caller
  }
}

size_t scalar_min_bytes(ValueType t) {
  switch (t) {
    case ValueType::kU8: case ValueType::kI8: case ValueType::kBool: return 1;
    case ValueType::kU16: case ValueType::kI16: return 2;
    case ValueType::kU32: case ValueType::kI32: case ValueType::kF32: return 4;
    default: return 8;  // 64-bit scalars and string lengths
  }
}

}  // namespace

File File::open(const std::string& path) {
  File f;
  f.path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(fmt::format("{}: not a regular file", path));
  }
  f.map_ = std::make_unique<Mapping>();
  f.map_->size = static_cast<size_t>(st.st_size);
  if (f.map_->size > 0) {
    void* p = mmap(nullptr, f.map_->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      f.map_->size = 0;
      throw Error(fmt::format("{}: mmap failed: {}", path, std::strerror(errno)));
    }
    f.map_->base = static_cast<const std::byte*>(p);
  }
  ::close(fd);

  Cursor c(f.path_, f.map_->base, f.map_->size);
  c.need(4, "magic");
  if (std::memcmp(f.map_->base, "GGUF", 4) != 0)
    throw Error(fmt::format("{}: not a GGUF file (bad magic)", path));
  c.read<uint32_t>("magic");
  f.version_ = c.read<uint32_t>("version");
  if (f.version_ != 2 && f.version_ != 3)
    throw Error(fmt::format("{}: unsupported GGUF version {} (need 2 or 3)", path, f.version_));
  const uint64_t n_tensors = c.read<uint64_t>("tensor count");
  const uint64_t n_kv = c.read<uint64_t>("metadata count");
  // Each KV takes at least 12 bytes and each tensor info at least 24: reject
  // counts the file cannot possibly hold before reserving anything.
  if (n_kv > f.map_->size / 12 || n_tensors > f.map_->size / 24)
    throw Error(fmt::format("{}: truncated or corrupt header ({} tensors, {} metadata keys in {} bytes)",
                            path, n_tensors, n_kv, f.map_->size));

  for (uint64_t k = 0; k < n_kv; ++k) {
    std::string key = c.read_string("metadata key");
    const uint32_t t = c.read<uint32_t>("metadata value type");
    if (!valid_value_type(t))
      throw Error(fmt::format("{}: metadata '{}' has unknown value type {}", path, key, t));
    Value v;
    v.type = static_cast<ValueType>(t);
    if (v.type == ValueType::kArray) {
      const uint32_t et = c.read<uint32_t>("array element type");
      if (!valid_value_type(et) || static_cast<ValueType>(et) == ValueType::kArray)
        throw Error(fmt::format("{}: metadata '{}' has unsupported array element type {}", path, key, et));
      v.array_type = static_cast<ValueType>(et);
      const uint64_t n = c.read<uint64_t>("array length");
      if (n > (f.map_->size - c.pos()) / scalar_min_bytes(v.array_type))
        throw Error(fmt::format("{}: truncated file: metadata '{}' array of {} {} does not fit", path,
                                key, n, value_type_name(v.array_type)));
      Value e;
      if (v.array_type == ValueType::kString) {
        v.strs.reserve(n);
        for (uint64_t i = 0; i < n; ++i) v.strs.push_back(c.read_string("array string"));
      } else if (v.array_type == ValueType::kF32 || v.array_type == ValueType::kF64) {
        v.floats.reserve(n);
        for (uint64_t i = 0; i < n; ++i) {
          read_scalar(c, v.array_type, e, "array element");
          v.floats.push_back(e.f);
        }
      } else {
        v.ints.reserve(n);
        for (uint64_t i = 0; i < n; ++i) {
          read_scalar(c, v.array_type, e, "array element");
          v.ints.push_back(e.i);
        }
      }
    } else {
      read_scalar(c, v.type, v, "metadata value");
    }
    f.kv_[key] = std::move(v);
  }

  if (const Value* a = f.find_kv("general.alignment")) {
    if (!a->is_integer() || a->u == 0 || (a->u & (a->u - 1)) != 0 || a->u > 65536)
      throw Error(fmt::format("{}: general.alignment must be a power of two, got {}", path, a->u));
    f.alignment_ = a->u;
  }

  struct Raw { uint64_t rel; };
  std::vector<Raw> rel(n_tensors);
  f.tensors_.resize(n_tensors);
  for (uint64_t i = 0; i < n_tensors; ++i) {
    TensorInfo& t = f.tensors_[i];
    t.name = c.read_string("tensor name");
    const uint32_t nd = c.read<uint32_t>("tensor dimension count");
    if (nd == 0 || nd > 4)
      throw Error(fmt::format("{}: tensor '{}' has {} dimensions (1..4 allowed)", path, t.name, nd));
    std::vector<int64_t> ne(nd);
    for (uint32_t d = 0; d < nd; ++d) {
      const uint64_t v = c.read<uint64_t>("tensor dimension");
      if (v == 0 || v > (uint64_t{1} << 40))
        throw Error(fmt::format("{}: tensor '{}' has invalid dimension {}", path, t.name, v));
      ne[d] = static_cast<int64_t>(v);
    }
    const uint32_t ty = c.read<uint32_t>("tensor type");
    t.type = static_cast<GgmlType>(ty);
    const BlockLayout bl = block_layout(t.type);
    if (bl.elems == 0)
      throw Error(fmt::format("{}: tensor '{}' has unknown tensor type {}", path, t.name, ty));
    rel[i].rel = c.read<uint64_t>("tensor offset");
    t.shape.assign(ne.rbegin(), ne.rend());
    if (ne[0] % bl.elems != 0)
      throw Error(fmt::format("{}: tensor '{}' row of {} elements is not a multiple of the {} block ({})",
                              path, t.name, ne[0], type_name(t.type), bl.elems));
    // numel <= 2^40 per dimension could overflow with 4 dims; bound the product.
    long double numel = 1;
    for (int64_t d : ne) numel *= static_cast<long double>(d);
    if (numel > static_cast<long double>(f.map_->size) * 256)
      throw Error(fmt::format("{}: tensor '{}' is larger than the file could hold", path, t.name));
    t.nbytes = static_cast<uint64_t>(t.numel() / bl.elems * bl.bytes);
    if (f.by_name_.count(t.name) != 0)
      throw Error(fmt::format("{}: duplicate tensor '{}'", path, t.name));
    f.by_name_[t.name] = i;
  }
  const uint64_t data_start = (c.pos() + f.alignment_ - 1) / f.alignment_ * f.alignment_;
  for (uint64_t i = 0; i < n_tensors; ++i) {
    TensorInfo& t = f.tensors_[i];
    if (rel[i].rel % f.alignment_ != 0)
      throw Error(fmt::format("{}: tensor '{}' offset {} is not aligned to {}", path, t.name, rel[i].rel,
                              f.alignment_));
    t.offset = data_start + rel[i].rel;
    if (t.offset < data_start || t.offset > f.map_->size || t.nbytes > f.map_->size - t.offset)
      throw Error(fmt::format("{}: truncated file: tensor '{}' needs bytes [{}, {}), file has {}", path,
                              t.name, t.offset, t.offset + t.nbytes, f.map_->size));
  }
  return f;
}

const Value* File::find_kv(const std::string& key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

std::string File::get_string(const std::string& key) const {
  const Value* v = find_kv(key);
  if (v == nullptr) throw Error(fmt::format("{}: missing metadata '{}'", path_, key));
  if (v->type != ValueType::kString)
    throw Error(fmt::format("{}: metadata '{}' is {}, expected string", path_, key, value_type_name(v->type)));
  return v->str;
}

int64_t File::get_int(const std::string& key) const {
  const Value* v = find_kv(key);
  if (v == nullptr) throw Error(fmt::format("{}: missing metadata '{}'", path_, key));
  if (!v->is_integer())
    throw Error(fmt::format("{}: metadata '{}' is {}, expected an integer", path_, key, value_type_name(v->type)));
  return v->i;
}

double File::get_float(const std::string& key) const {
  const Value* v = find_kv(key);
  if (v == nullptr) throw Error(fmt::format("{}: missing metadata '{}'", path_, key));
  if (v->is_float()) return v->f;
  if (v->is_integer()) return static_cast<double>(v->i);
  throw Error(fmt::format("{}: metadata '{}' is {}, expected a number", path_, key, value_type_name(v->type)));
}

std::string File::get_string(const std::string& key, const std::string& dflt) const {
  return find_kv(key) ? get_string(key) : dflt;
}
int64_t File::get_int(const std::string& key, int64_t dflt) const {
  return find_kv(key) ? get_int(key) : dflt;
}
double File::get_float(const std::string& key, double dflt) const {
  return find_kv(key) ? get_float(key) : dflt;
}
bool File::get_bool(const std::string& key, bool dflt) const {
  const Value* v = find_kv(key);
  if (v == nullptr) return dflt;
  if (v->type == ValueType::kBool) return v->b;
  if (v->is_integer()) return v->i != 0;
  throw Error(fmt::format("{}: metadata '{}' is {}, expected bool", path_, key, value_type_name(v->type)));
}

const TensorInfo* File::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

const TensorInfo& File::at(const std::string& name) const {
  const TensorInfo* t = find(name);
  if (t == nullptr) throw Error(fmt::format("{}: missing tensor '{}'", path_, name));
  return *t;
}

const std::byte* File::data(const TensorInfo& t) const { return map_->base + t.offset; }

std::vector<float> File::read_f32(const TensorInfo& t) const {
  if (!can_dequantize(t.type))
    throw Error(fmt::format("{}: tensor '{}' has type {}, which this loader cannot dequantize", path_,
                            t.name, type_name(t.type)));
  std::vector<float> out(static_cast<size_t>(t.numel()));
  // Large tensors (the embedding, big matrices) are split over threads by
  // whole blocks; loading is otherwise one core decoding ~100M values.
  const BlockLayout bl = block_layout(t.type);
  const int64_t blocks = t.numel() / bl.elems;
  const int64_t min_blocks = (int64_t{1} << 20) / bl.elems;
  const int nt = static_cast<int>(std::min<int64_t>(std::max(1u, std::thread::hardware_concurrency()),
                                                    std::max<int64_t>(1, blocks / std::max<int64_t>(1, min_blocks))));
  if (nt <= 1) {
    dequantize(t.type, data(t), out.data(), t.numel());
    return out;
  }
  std::vector<std::thread> pool;
  for (int i = 0; i < nt; ++i) {
    const int64_t b0 = blocks * i / nt, b1 = blocks * (i + 1) / nt;
    pool.emplace_back([&, b0, b1] {
      dequantize(t.type, data(t) + b0 * bl.bytes, out.data() + b0 * bl.elems, (b1 - b0) * bl.elems);
    });
  }
  for (auto& th : pool) th.join();
  return out;
}

}  // namespace oscar::model::gguf
