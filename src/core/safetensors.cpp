#include "core/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <immintrin.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <utility>

#include "core/error.h"
#include "core/half.h"

namespace oscar::st {

namespace {

constexpr uint64_t kMaxHeader = 100ull << 20;  // the safetensors library's own limit

struct DtypeName {
  Dtype dt;
  const char* name;
  size_t size;
};
constexpr DtypeName kDtypes[] = {
    {Dtype::F64, "F64", 8},   {Dtype::F32, "F32", 4}, {Dtype::F16, "F16", 2},
    {Dtype::BF16, "BF16", 2}, {Dtype::I64, "I64", 8}, {Dtype::I32, "I32", 4},
    {Dtype::I16, "I16", 2},   {Dtype::I8, "I8", 1},   {Dtype::U8, "U8", 1},
    {Dtype::BOOL, "BOOL", 1},
};

bool dtype_from_name(const std::string& s, Dtype* out) {
  for (const auto& d : kDtypes)
    if (s == d.name) {
      *out = d.dt;
      return true;
    }
  return false;
}

// numel of a shape, or -1 on a negative dim / overflow.
int64_t checked_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) {
    if (s < 0) return -1;
    if (__builtin_mul_overflow(n, s, &n)) return -1;
  }
  return n;
}

}  // namespace

size_t dtype_size(Dtype dt) {
  for (const auto& d : kDtypes)
    if (d.dt == dt) return d.size;
  throw Error("safetensors: unknown dtype enum value");
}

const char* dtype_name(Dtype dt) {
  for (const auto& d : kDtypes)
    if (d.dt == dt) return d.name;
  return "?";
}

int64_t TensorInfo::numel() const {
  return checked_numel(shape);
}

namespace {
// F16C / AVX-512 conversion, 16 values per instruction; chosen at run time
// (the default build targets x86-64-v2, which has no F16C).
__attribute__((target("avx512f"))) void f16_to_f32_avx512(const std::byte* src, int64_t n,
                                                          float* out) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(
        out + i, _mm512_maskz_cvtph_ps(
                     0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 2 * i))));
  for (; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, src + 2 * i, 2);
    out[i] = f16_to_f32(h);
  }
}
bool cpu_has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f");
  return ok;
}
}  // namespace

void convert_to_f32(Dtype dt, const std::byte* src, int64_t count, float* out) {
  if (dt == Dtype::F16 && cpu_has_avx512()) {
    f16_to_f32_avx512(src, count, out);  // IEEE conversion: identical to f16_to_f32
    return;
  }
  switch (dt) {
    case Dtype::F32:
      std::memcpy(out, src, static_cast<size_t>(count) * 4);
      return;
    case Dtype::F16: {
      // A 256 KiB lookup table beats bit manipulation without F16C (the
      // default x86-64-v2 build) and is exact by construction.
      static const std::vector<float> table = [] {
        std::vector<float> t(65536);
        for (uint32_t h = 0; h < 65536; ++h) t[h] = f16_to_f32(static_cast<uint16_t>(h));
        return t;
      }();
      for (int64_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = table[h];
      }
      return;
    }
    case Dtype::BF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = bf16_to_f32(h);
      }
      return;
    case Dtype::F64:
      for (int64_t i = 0; i < count; ++i) {
        double v;
        std::memcpy(&v, src + 8 * i, 8);
        out[i] = static_cast<float>(v);
      }
      return;
    default:
      throw Error(fmt::format("safetensors: cannot convert dtype {} to f32", dtype_name(dt)));
  }
}

// ---------------------------------------------------------------------------
// File

File::File(File&& o) noexcept {
  *this = std::move(o);
}

File& File::operator=(File&& o) noexcept {
  if (this != &o) {
    if (map_) munmap(map_, size_);
    path_ = std::move(o.path_);
    map_ = std::exchange(o.map_, nullptr);
    size_ = std::exchange(o.size_, 0);
    data_block_ = std::exchange(o.data_block_, nullptr);
    metadata_ = std::move(o.metadata_);
    tensors_ = std::move(o.tensors_);
  }
  return *this;
}

File::~File() {
  if (map_) munmap(map_, size_);
}

File File::open(const std::string& path) {
  File f;
  f.path_ = path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  struct stat sb {};
  if (fstat(fd, &sb) != 0) {
    const int e = errno;
    ::close(fd);
    throw Error(fmt::format("{}: cannot stat: {}", path, std::strerror(e)));
  }
  if (!S_ISREG(sb.st_mode)) {
    ::close(fd);
    throw Error(fmt::format("{}: not a regular file", path));
  }
  const uint64_t size = static_cast<uint64_t>(sb.st_size);
  if (size < 8) {
    ::close(fd);
    throw Error(fmt::format(
        "{}: not a safetensors file (only {} bytes, need an 8-byte header length)", path, size));
  }
  void* m = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (m == MAP_FAILED)
    throw Error(fmt::format("{}: mmap failed: {}", path, std::strerror(map_errno)));
  f.map_ = m;
  f.size_ = size;
  const auto* base = static_cast<const std::byte*>(m);

  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(base[i]) << (8 * i);
  if (n > kMaxHeader)
    throw Error(
        fmt::format("{}: header length {} exceeds the {} byte limit (not a safetensors file?)",
                    path, n, kMaxHeader));
  if (n > size - 8)
    throw Error(fmt::format("{}: truncated header ({} of {} bytes present)", path, size - 8, n));
  const char* hb = reinterpret_cast<const char*>(base + 8);
  nlohmann::json j = nlohmann::json::parse(hb, hb + n, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw Error(fmt::format("{}: header is not valid JSON", path));
  if (!j.is_object()) throw Error(fmt::format("{}: header JSON is not an object", path));

  f.data_block_ = base + 8 + n;
  const uint64_t data_size = size - 8 - n;
  std::vector<const TensorInfo*> order;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& key = it.key();
    const nlohmann::json& v = it.value();
    if (key == "__metadata__") {
      if (!v.is_object()) throw Error(fmt::format("{}: __metadata__ is not an object", path));
      for (auto m2 = v.begin(); m2 != v.end(); ++m2) {
        if (!m2.value().is_string())
          throw Error(fmt::format("{}: metadata value of '{}' is not a string", path, m2.key()));
        f.metadata_[m2.key()] = m2.value().get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& what) {
      return Error(fmt::format("{}: tensor '{}': {}", path, key, what));
    };
    if (!v.is_object()) throw bad("entry is not an object");
    auto dt_it = v.find("dtype");
    auto sh_it = v.find("shape");
    auto off_it = v.find("data_offsets");
    if (dt_it == v.end() || !dt_it->is_string()) throw bad("missing or non-string 'dtype'");
    if (sh_it == v.end() || !sh_it->is_array()) throw bad("missing or non-array 'shape'");
    if (off_it == v.end() || !off_it->is_array() || off_it->size() != 2)
      throw bad("missing 'data_offsets' [begin, end]");
    TensorInfo t;
    t.name = key;
    if (!dtype_from_name(dt_it->get<std::string>(), &t.dtype))
      throw bad(fmt::format("unsupported dtype '{}'", dt_it->get<std::string>()));
    for (const auto& s : *sh_it) {
      if (!s.is_number_integer() || s.get<int64_t>() < 0)
        throw bad("shape has a non-integer or negative dim");
      t.shape.push_back(s.get<int64_t>());
    }
    for (const auto& o : *off_it)
      if (!o.is_number_unsigned()) throw bad("data_offsets are not non-negative integers");
    t.begin = (*off_it)[0].get<uint64_t>();
    t.end = (*off_it)[1].get<uint64_t>();
    if (t.begin > t.end)
      throw bad(fmt::format("data_offsets [{}, {}] are reversed", t.begin, t.end));
    if (t.end > data_size)
      throw bad(fmt::format("data [{}, {}) lies beyond the data block ({} bytes; file truncated?)",
                            t.begin, t.end, data_size));
    const int64_t numel = checked_numel(t.shape);
    uint64_t want = 0;
    if (numel < 0 ||
        __builtin_mul_overflow(static_cast<uint64_t>(numel), dtype_size(t.dtype), &want))
      throw bad("shape overflows");
    if (want != t.end - t.begin)
      throw bad(fmt::format("{} bytes of data but dtype {} x shape needs {}", t.end - t.begin,
                            dtype_name(t.dtype), want));
    f.tensors_.emplace(key, std::move(t));
  }
  for (const auto& [k, t] : f.tensors_)
    if (t.end > t.begin) order.push_back(&t);  // empty tensors occupy no bytes
  std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < order.size(); ++i)
    if (order[i]->begin < order[i - 1]->end)
      throw Error(fmt::format("{}: tensors '{}' and '{}' overlap", path, order[i - 1]->name,
                              order[i]->name));
  return f;
}

std::string File::meta(const std::string& key, const std::string& fallback) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? fallback : it->second;
}

const TensorInfo* File::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

const TensorInfo& File::at(const std::string& name) const {
  const TensorInfo* t = find(name);
  if (!t) throw Error(fmt::format("{}: no tensor named '{}'", path_, name));
  return *t;
}

std::vector<std::string> File::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [k, t] : tensors_) out.push_back(k);
  return out;
}

const std::byte* File::data(const TensorInfo& t) const {
  return data_block_ + t.begin;
}

std::vector<float> File::read_f32(const std::string& name) const {
  const TensorInfo& t = at(name);
  std::vector<float> out(static_cast<size_t>(t.numel()));
  read_f32_range(t, 0, t.numel(), out.data());
  return out;
}

void File::read_f32_range(const TensorInfo& t, int64_t first, int64_t count, float* out) const {
  if (t.dtype != Dtype::F32 && t.dtype != Dtype::F16 && t.dtype != Dtype::BF16 &&
      t.dtype != Dtype::F64)
    throw Error(fmt::format("{}: tensor '{}' has dtype {}, expected a float dtype", path_, t.name,
                            dtype_name(t.dtype)));
  if (first < 0 || count < 0 || first + count > t.numel())
    throw Error(fmt::format("{}: tensor '{}': element range [{}, {}) out of bounds ({} elements)",
                            path_, t.name, first, first + count, t.numel()));
  const std::byte* src = data(t) + first * static_cast<int64_t>(dtype_size(t.dtype));
  // Large reads: populate the page tables of the range in one call instead of
  // one fault per 4 KiB page (cut the system time of a 7 GB dump read ~4x).
  // MADV_POPULATE_READ needs Linux 5.14; on failure the faults just happen.
  const uint64_t bytes = static_cast<uint64_t>(count) * dtype_size(t.dtype);
  if (bytes >= (1u << 20)) {
    const uintptr_t page = 4096, b = reinterpret_cast<uintptr_t>(src) & ~(page - 1);
    const uintptr_t e = reinterpret_cast<uintptr_t>(src) + bytes;
#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
    (void)madvise(reinterpret_cast<void*>(b), e - b, MADV_POPULATE_READ);
  }
  convert_to_f32(t.dtype, src, count, out);
}

// ---------------------------------------------------------------------------
// Writer

void Writer::add(const std::string& name, Dtype dt, std::vector<int64_t> shape, const void* bytes,
                 size_t nbytes) {
  if (name.empty() || name == "__metadata__")
    throw Error(fmt::format("safetensors writer: invalid tensor name '{}'", name));
  for (const auto& e : entries_)
    if (e.name == name) throw Error(fmt::format("safetensors writer: duplicate tensor '{}'", name));
  const int64_t numel = checked_numel(shape);
  if (numel < 0) throw Error(fmt::format("safetensors writer: tensor '{}' has a bad shape", name));
  if (static_cast<uint64_t>(numel) * dtype_size(dt) != nbytes)
    throw Error(fmt::format("safetensors writer: tensor '{}': {} bytes given, shape x {} needs {}",
                            name, nbytes, dtype_name(dt),
                            static_cast<uint64_t>(numel) * dtype_size(dt)));
  Entry e{name, dt, std::move(shape), std::vector<std::byte>(nbytes)};
  if (nbytes) std::memcpy(e.bytes.data(), bytes, nbytes);
  entries_.push_back(std::move(e));
}

void Writer::add_f32(const std::string& name, std::vector<int64_t> shape, const float* data) {
  const int64_t numel = checked_numel(shape);
  if (numel < 0) throw Error(fmt::format("safetensors writer: tensor '{}' has a bad shape", name));
  add(name, Dtype::F32, std::move(shape), data, static_cast<size_t>(numel) * 4);
}

void Writer::set_metadata(const std::string& key, const std::string& value) {
  metadata_[key] = value;
}

void Writer::write(const std::string& path) const {
  // Order like the Python library: larger dtypes first, then by name, so every
  // tensor is naturally aligned in the (8-aligned) data block.
  std::vector<const Entry*> order;
  for (const auto& e : entries_) order.push_back(&e);
  std::sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    const size_t sa = dtype_size(a->dtype), sb = dtype_size(b->dtype);
    return sa != sb ? sa > sb : a->name < b->name;
  });
  nlohmann::json j = nlohmann::json::object();
  if (!metadata_.empty()) j["__metadata__"] = metadata_;
  uint64_t off = 0;
  for (const Entry* e : order) {
    j[e->name] = {{"dtype", dtype_name(e->dtype)},
                  {"shape", e->shape},
                  {"data_offsets", {off, off + e->bytes.size()}}};
    off += e->bytes.size();
  }
  std::string header = j.dump();
  header.append((8 - header.size() % 8) % 8, ' ');

  const std::string tmp = path + ".tmp";
  FILE* fp = std::fopen(tmp.c_str(), "wb");
  if (!fp) throw Error(fmt::format("{}: cannot create: {}", tmp, std::strerror(errno)));
  bool ok = true;
  uint8_t len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * i));
  ok = ok && std::fwrite(len, 1, 8, fp) == 8;
  ok = ok && std::fwrite(header.data(), 1, header.size(), fp) == header.size();
  for (const Entry* e : order)
    ok = ok && (e->bytes.empty() ||
                std::fwrite(e->bytes.data(), 1, e->bytes.size(), fp) == e->bytes.size());
  ok = (std::fclose(fp) == 0) && ok;
  if (!ok) {
    std::remove(tmp.c_str());
    throw Error(fmt::format("{}: write failed: {}", tmp, std::strerror(errno)));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp.c_str());
    throw Error(fmt::format("{}: cannot rename from {}: {}", path, tmp, std::strerror(e)));
  }
}

// ---------------------------------------------------------------------------
// StreamWriter

StreamWriter::StreamWriter(const std::string& path, const std::vector<Decl>& tensors,
                           const std::map<std::string, std::string>& metadata)
    : path_(path), tmp_(path + ".tmp") {
  nlohmann::json j = nlohmann::json::object();
  if (!metadata.empty()) j["__metadata__"] = metadata;
  uint64_t off = 0;
  for (const Decl& t : tensors) {
    const int64_t numel = checked_numel(t.shape);
    if (numel < 0 || t.name.empty() || t.name == "__metadata__" || j.contains(t.name))
      throw Error(fmt::format("{}: bad or duplicate tensor declaration '{}'", path, t.name));
    const uint64_t n = static_cast<uint64_t>(numel) * dtype_size(t.dtype);
    j[t.name] = {
        {"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {off, off + n}}};
    off += n;
  }
  expected_ = off;
  std::string header = j.dump();
  header.append((8 - header.size() % 8) % 8, ' ');
  FILE* fp = std::fopen(tmp_.c_str(), "wb");
  if (!fp) throw Error(fmt::format("{}: cannot create: {}", tmp_, std::strerror(errno)));
  fp_ = fp;
  uint8_t len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * i));
  if (std::fwrite(len, 1, 8, fp) != 8 ||
      std::fwrite(header.data(), 1, header.size(), fp) != header.size())
    throw Error(fmt::format("{}: write failed: {}", tmp_, std::strerror(errno)));
}

StreamWriter::~StreamWriter() {
  if (fp_) {
    std::fclose(static_cast<FILE*>(fp_));
    std::remove(tmp_.c_str());
  }
}

void StreamWriter::append(const void* bytes, size_t n) {
  if (!fp_) throw Error(fmt::format("{}: stream writer already finished", path_));
  if (written_ + n > expected_)
    throw Error(fmt::format("{}: {} bytes appended beyond the declared {}", path_, written_ + n,
                            expected_));
  if (n && std::fwrite(bytes, 1, n, static_cast<FILE*>(fp_)) != n)
    throw Error(fmt::format("{}: write failed: {}", tmp_, std::strerror(errno)));
  written_ += n;
}

void StreamWriter::finish() {
  if (!fp_) return;
  if (written_ != expected_)
    throw Error(fmt::format("{}: {} of {} declared bytes written", path_, written_, expected_));
  FILE* fp = static_cast<FILE*>(fp_);
  fp_ = nullptr;
  if (std::fclose(fp) != 0) {
    std::remove(tmp_.c_str());
    throw Error(fmt::format("{}: close failed: {}", tmp_, std::strerror(errno)));
  }
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int e = errno;
    std::remove(tmp_.c_str());
    throw Error(fmt::format("{}: cannot rename from {}: {}", path_, tmp_, std::strerror(e)));
  }
}

}  // namespace oscar::st
