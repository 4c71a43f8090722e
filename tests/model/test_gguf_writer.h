// A minimal GGUF v3 writer for tests: builds files byte by byte so tests can
// make valid models and precisely broken ones.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace oscar::test {

class GgufWriter {
 public:
  uint32_t version = 3;
  uint64_t alignment = 32;
  char magic[4] = {'G', 'G', 'U', 'F'};

  void kv_u32(const std::string& k, uint32_t v) { key(k, 4); pod(kv_, v); }
  void kv_i32(const std::string& k, int32_t v) { key(k, 5); pod(kv_, v); }
  void kv_f32(const std::string& k, float v) { key(k, 6); pod(kv_, v); }
  void kv_bool(const std::string& k, bool v) { key(k, 7); pod(kv_, uint8_t(v ? 1 : 0)); }
  void kv_str(const std::string& k, const std::string& v) { key(k, 8); str(kv_, v); }
  void kv_u64(const std::string& k, uint64_t v) { key(k, 10); pod(kv_, v); }
  void kv_strs(const std::string& k, const std::vector<std::string>& v) {
    key(k, 9);
    pod(kv_, uint32_t(8));
    pod(kv_, uint64_t(v.size()));
    for (const auto& s : v) str(kv_, s);
  }
  void kv_i32s(const std::string& k, const std::vector<int32_t>& v) {
    key(k, 9);
    pod(kv_, uint32_t(5));
    pod(kv_, uint64_t(v.size()));
    for (int32_t x : v) pod(kv_, x);
  }
  // shape outermost first (as the loader reports it); data = raw block bytes.
  void tensor(const std::string& name, std::vector<int64_t> shape, uint32_t type,
              const void* data, size_t nbytes) {
    Tensor t{name, {}, type, std::string(static_cast<const char*>(data), nbytes)};
    for (auto it = shape.rbegin(); it != shape.rend(); ++it) t.ne.push_back(uint64_t(*it));
    tensors_.push_back(std::move(t));
  }
  void tensor_f32(const std::string& name, std::vector<int64_t> shape, const std::vector<float>& v) {
    tensor(name, std::move(shape), 0, v.data(), v.size() * 4);
  }

  std::string bytes() const {
    std::string b(magic, 4);
    pod(b, version);
    pod(b, uint64_t(tensors_.size()));
    pod(b, n_kv_);
    b += kv_;
    uint64_t off = 0;
    std::vector<uint64_t> offs;
    for (const auto& t : tensors_) {
      str(b, t.name);
      pod(b, uint32_t(t.ne.size()));
      for (uint64_t d : t.ne) pod(b, d);
      pod(b, t.type);
      pod(b, off);
      offs.push_back(off);
      off = (off + t.data.size() + alignment - 1) / alignment * alignment;
    }
    b.resize((b.size() + alignment - 1) / alignment * alignment, '\0');
    const size_t base = b.size();
    for (size_t i = 0; i < tensors_.size(); ++i) {
      b.resize(base + offs[i], '\0');
      b += tensors_[i].data;
    }
    return b;
  }
  void write(const std::string& path) const {
    std::ofstream o(path, std::ios::binary | std::ios::trunc);
    const std::string b = bytes();
    o.write(b.data(), std::streamsize(b.size()));
  }

 private:
  struct Tensor {
    std::string name;
    std::vector<uint64_t> ne;
    uint32_t type;
    std::string data;
  };
  template <typename T>
  static void pod(std::string& b, T v) {
    char c[sizeof(T)];
    std::memcpy(c, &v, sizeof(T));
    b.append(c, sizeof(T));
  }
  static void str(std::string& b, const std::string& s) {
    pod(b, uint64_t(s.size()));
    b += s;
  }
  void key(const std::string& k, uint32_t type) {
    str(kv_, k);
    pod(kv_, type);
    ++n_kv_;
  }
  std::string kv_;
  uint64_t n_kv_ = 0;
  std::vector<Tensor> tensors_;
};

inline void write_bytes(const std::string& path, const std::string& b) {
  std::ofstream o(path, std::ios::binary | std::ios::trunc);
  o.write(b.data(), std::streamsize(b.size()));
}

}  // namespace oscar::test
