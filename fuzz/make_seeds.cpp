// Writes the seed corpora of the fuzz targets into <out>/<target>/: small valid
// files of every kind the readers accept (each checked by loading it with the
// real reader), plus the small files under tests/data and the first 64 KiB of the
// default model when it is present. Whole real files would be too large for
// libFuzzer's input limit (the default model's header alone is 2 MB of
// vocabulary), so the model seeds are built here with tiny shapes but the same
// metadata keys, tensor names and block types a real GGUF has.
//   usage: fuzz_make_seeds <out-dir>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "../tests/model/test_gguf_writer.h"
#include "core/activation_dump.h"
#include "core/calibration.h"
#include "core/error.h"
#include "core/half.h"
#include "core/safetensors.h"
#include "fuzz_util.h"
#include "model/gguf.h"
#include "model/loader.h"
#include "model/tokenizer.h"

namespace fs = std::filesystem;
using namespace oscar;
using json = nlohmann::json;

namespace {

fs::path g_out;

fs::path dir_of(const std::string& target) {
  fs::path d = g_out / target;
  fs::create_directories(d);
  return d;
}

void copy_in(const std::string& target, const fs::path& src, const std::string& name) {
  fs::copy_file(src, dir_of(target) / name, fs::copy_options::overwrite_existing);
}

void write_text(const std::string& target, const std::string& name, const std::string& text) {
  std::ofstream(dir_of(target) / name, std::ios::binary) << text;
}

std::vector<float> randn(size_t n, std::mt19937& rng, float scale = 0.1f) {
  std::normal_distribution<float> nd(0.f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

// Q8_0 blocks (32 values: fp16 scale + 32 int8) of a row-major [rows][cols] matrix.
std::string q8_0(const std::vector<float>& v) {
  std::string b;
  for (size_t i = 0; i < v.size(); i += 32) {
    float amax = 0.f;
    for (size_t j = 0; j < 32; ++j) amax = std::max(amax, std::abs(v[i + j]));
    const float d = amax / 127.f;
    const uint16_t h = f32_to_f16(d);
    b.append(reinterpret_cast<const char*>(&h), 2);
    for (size_t j = 0; j < 32; ++j) b.push_back(static_cast<char>(d > 0 ? std::lround(v[i + j] / d) : 0));
  }
  return b;
}

std::string f16(const std::vector<float>& v) {
  std::string b;
  for (float x : v) {
    const uint16_t h = f32_to_f16(x);
    b.append(reinterpret_cast<const char*>(&h), 2);
  }
  return b;
}

// A one-layer model of `arch` with hidden 32, 2 query / 1 KV heads of 16, FFN 64,
// and the tiny test tokenizer (tests/data/model/tiny-llama/tokenizer.json) in
// GGUF's tokenizer.ggml.* form.
void gguf_model(const std::string& arch, const fs::path& path) {
  const fs::path tj = fs::path(fuzz::source_dir()) / "tests/data/model/tiny-llama/tokenizer.json";
  const json tok = json::parse(std::ifstream(tj));
  std::vector<std::string> tokens(tok["model"]["vocab"].size());
  for (auto it = tok["model"]["vocab"].begin(); it != tok["model"]["vocab"].end(); ++it)
    tokens.at(it.value().get<size_t>()) = it.key();
  std::vector<int32_t> types(tokens.size(), 1);
  for (const json& a : tok["added_tokens"]) {
    const size_t id = a["id"].get<size_t>();
    if (id >= tokens.size()) tokens.resize(id + 1), types.resize(id + 1, 1);
    tokens[id] = a["content"].get<std::string>();
    types[id] = a.value("special", false) ? 3 : 4;
  }
  std::vector<std::string> merges;
  for (const json& m : tok["model"]["merges"])
    merges.push_back(m.is_string() ? m.get<std::string>() : m[0].get<std::string>() + " " + m[1].get<std::string>());

  const int H = 32, F = 64, hd = 16, nq = 2, nkv = 1, V = static_cast<int>(tokens.size());
  std::mt19937 rng(7);
  test::GgufWriter w;
  w.kv_str("general.architecture", arch);
  w.kv_str("general.name", "fuzz-seed-" + arch);
  const std::string p = arch + ".";
  w.kv_u32(p + "block_count", 1);
  w.kv_u32(p + "context_length", 256);
  w.kv_u32(p + "embedding_length", H);
  w.kv_u32(p + "feed_forward_length", F);
  w.kv_u32(p + "attention.head_count", nq);
  w.kv_u32(p + "attention.head_count_kv", nkv);
  w.kv_u32(p + "attention.key_length", hd);
  w.kv_u32(p + "attention.value_length", hd);
  w.kv_f32(p + "rope.freq_base", 10000.f);
  w.kv_f32(p + "attention.layer_norm_rms_epsilon", 1e-6f);
  w.kv_str("tokenizer.ggml.model", "gpt2");
  w.kv_str("tokenizer.ggml.pre", arch == "llama" ? "llama-bpe" : "qwen2");
  w.kv_strs("tokenizer.ggml.tokens", tokens);
  w.kv_i32s("tokenizer.ggml.token_type", types);
  w.kv_strs("tokenizer.ggml.merges", merges);
  w.kv_u32("tokenizer.ggml.bos_token_id", 1);
  w.kv_u32("tokenizer.ggml.eos_token_id", 2);
  w.kv_bool("tokenizer.ggml.add_bos_token", arch == "llama");
  w.kv_str("tokenizer.chat_template",
           "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>{% endif %}");
  auto put_q8 = [&](const std::string& n, int rows, int cols) {
    const std::string b = q8_0(randn(size_t(rows) * cols, rng));
    w.tensor(n, {rows, cols}, 8, b.data(), b.size());
  };
  auto put_f16 = [&](const std::string& n, int rows, int cols) {
    const std::string b = f16(randn(size_t(rows) * cols, rng));
    w.tensor(n, {rows, cols}, 1, b.data(), b.size());
  };
  auto put_f32 = [&](const std::string& n, int len) {
    std::vector<float> v = randn(size_t(len), rng);
    for (float& x : v) x += 1.f;
    w.tensor_f32(n, {len}, v);
  };
  put_q8("token_embd.weight", V, H);
  put_f32("output_norm.weight", H);
  put_f32("blk.0.attn_norm.weight", H);
  put_q8("blk.0.attn_q.weight", nq * hd, H);
  put_f16("blk.0.attn_k.weight", nkv * hd, H);
  put_f16("blk.0.attn_v.weight", nkv * hd, H);
  if (arch == "qwen2") {
    put_f32("blk.0.attn_q.bias", nq * hd);
    put_f32("blk.0.attn_k.bias", nkv * hd);
    put_f32("blk.0.attn_v.bias", nkv * hd);
  }
  if (arch == "qwen3") {
    put_f32("blk.0.attn_q_norm.weight", hd);
    put_f32("blk.0.attn_k_norm.weight", hd);
  }
  put_q8("blk.0.attn_output.weight", H, nq * hd);
  put_f32("blk.0.ffn_norm.weight", H);
  put_q8("blk.0.ffn_gate.weight", F, H);
  put_q8("blk.0.ffn_up.weight", F, H);
  put_q8("blk.0.ffn_down.weight", H, F);
  w.write(path.string());
  (void)model::load_gguf(path.string());  // the seed must be a valid model
  (void)model::Tokenizer::from_gguf(path.string());
}

Calibration calibration(bool per_head, bool key_transform) {
  ModelFingerprint m;
  m.architecture = "qwen2";
  m.n_layers = 2;
  m.n_q_heads = 4;
  m.n_kv_heads = 2;
  m.head_dim = 16;
  m.weights_hash = "00112233445566778899aabbccddeeff";
  Calibration c = data_free_calibration(Composition::kHadamard, m, 0.95f, 1.0f, 2, 16);
  if (per_head)
    for (LayerCalibration& L : c.layers) {
      L.n_rot = m.n_kv_heads;
      c.granularity = Granularity::kHead;
      std::vector<float> k = L.k_rotation, v = L.v_rotation;
      L.k_rotation.insert(L.k_rotation.end(), k.begin(), k.end());
      L.v_rotation.insert(L.v_rotation.end(), v.begin(), v.end());
      L.k_clip = {0.9f, 0.95f};
      L.v_clip = {1.f, 0.97f};
      L.k_eigenvalues.assign(size_t(m.n_kv_heads * m.head_dim), 1.f);
      L.v_eigenvalues.assign(size_t(m.n_kv_heads * m.head_dim), 0.5f);
    }
  if (key_transform) {
    c.key_transform = "center+scale";
    std::mt19937 rng(3);
    for (LayerCalibration& L : c.layers) {
      L.k_mean = randn(size_t(m.n_kv_heads * m.head_dim), rng, 3.f);
      L.k_scale.assign(size_t(m.n_kv_heads * m.head_dim), 1.5f);
    }
  }
  return c;
}

void activation_dump(const fs::path& path, st::Dtype dt, bool with_o) {
  const int L = 2, T = 9, Hq = 4, Hkv = 2, d = 8;
  std::mt19937 rng(11);
  st::Writer w;
  w.set_metadata("model.architecture", "llama");
  w.set_metadata("calib.text_hash", "abc");
  for (int l = 0; l < L; ++l)
    for (char which : {'q', 'k', 'v', 'o'}) {
      if (which == 'o' && !with_o) continue;
      const int h = (which == 'q' || which == 'o') ? Hq : Hkv;
      const std::vector<float> v = randn(size_t(T * h * d), rng, 1.f);
      const std::string name = fmt::format("layers.{}.{}", l, which);
      if (dt == st::Dtype::F32) {
        w.add_f32(name, {T, h, d}, v.data());
      } else {
        const std::string b = f16(v);
        w.add(name, st::Dtype::F16, {T, h, d}, b.data(), b.size());
      }
    }
  w.write(path.string());
  (void)ActivationDump::open(path.string());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <out-dir>\n", argv[0]);
    return 2;
  }
  g_out = argv[1];
  const fs::path src = fuzz::source_dir();
  const fs::path data = src / "tests/data/model";
  try {
    // GGUF: tiny models of each architecture, the dequantizer test file (every block type).
    for (const char* arch : {"llama", "qwen2", "qwen3"})
      gguf_model(arch, dir_of("gguf") / fmt::format("tiny-{}.gguf", arch));
    copy_in("gguf", data / "dequant.gguf", "dequant.gguf");
    // The default model's first 64 KiB (header, architecture keys, the start of the
    // vocabulary), when scripts/fetch_model.sh has fetched it: a real file's layout,
    // cut where the fuzzer's input limit cuts it.
    const fs::path real = src / "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    if (fs::exists(real)) {
      std::ifstream in(real, std::ios::binary);
      std::string head(64 * 1024, '\0');
      in.read(head.data(), static_cast<std::streamsize>(head.size()));
      head.resize(static_cast<size_t>(in.gcount()));
      write_text("gguf", "smollm2-head.gguf", head);
    }

    // Calibration files: per layer, per head, with the key transform.
    write_calibration(calibration(false, false), (dir_of("calibration") / "layer.safetensors").string());
    write_calibration(calibration(true, false), (dir_of("calibration") / "head.safetensors").string());
    write_calibration(calibration(true, true), (dir_of("calibration") / "keyxf.safetensors").string());
    for (const auto& e : fs::directory_iterator(dir_of("calibration")))
      (void)read_calibration(e.path().string());

    // Activation dumps: f32 with attention outputs, f16 without.
    activation_dump(dir_of("activation_dump") / "f32_o.safetensors", st::Dtype::F32, true);
    activation_dump(dir_of("activation_dump") / "f16.safetensors", st::Dtype::F16, false);

    // safetensors: all of the above plus the small golden files of the tests.
    for (const char* t : {"calibration", "activation_dump"})
      for (const auto& e : fs::directory_iterator(dir_of(t)))
        copy_in("safetensors", e.path(), std::string(t) + "-" + e.path().filename().string());
    copy_in("safetensors", data / "dequant_expected.safetensors", "dequant_expected.safetensors");
    copy_in("safetensors", data / "tiny-qwen2/golden.safetensors", "golden.safetensors");

    // tokenizer.json of the tiny test models.
    for (const char* m : {"tiny-llama", "tiny-qwen2"})
      copy_in("tokenizer_json", data / m / "tokenizer.json", std::string(m) + ".json");

    // Texts for the round trip.
    const char* texts[] = {
        "Hello, world!",
        "def f(x):\n    return x ** 2  # square\n\n\n",
        "caf\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x98\x80 \xff\xfe broken utf-8 \xc3",
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "   leading spaces and\ttabs\r\nCRLF 12345678 's 't 're",
    };
    for (size_t i = 0; i < std::size(texts); ++i) write_text("tokenizer", fmt::format("text{}.txt", i), texts[i]);

    // HTTP request bodies.
    const char* bodies[] = {
        R"({"model":"m","prompt":"Once upon a time","max_tokens":16,"temperature":0.7,"top_p":0.9,"stop":["\n"]})",
        R"({"prompt":[1,2,3,4],"max_tokens":4,"stream":true,"stream_options":{"include_usage":true}})",
        R"({"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"}],"max_tokens":8,"seed":3})",
        R"({"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],"top_k":5,"ignore_eos":true})",
        R"({"messages":[{"role":"user","content":"x","name":"bob"}],"frequency_penalty":0.5,"presence_penalty":0.1,"n":1,"stop":"END"})",
    };
    for (size_t i = 0; i < std::size(bodies); ++i) write_text("openai_request", fmt::format("body{}.json", i), bodies[i]);

    // Chat templates: the two real ones the tests keep, and ChatML.
    copy_in("chat_template", src / "tests/serve/data/smollm2.jinja", "smollm2.jinja");
    copy_in("chat_template", src / "tests/serve/data/qwen2.5-coder.jinja", "qwen2.5-coder.jinja");
  } catch (const Error& e) {
    std::fprintf(stderr, "fuzz_make_seeds: %s\n", e.what());
    return 1;
  }
  std::printf("fuzz_make_seeds: corpora written under %s\n", g_out.c_str());
  return 0;
}
