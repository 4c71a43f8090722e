// Byte-level BPE: pre-tokenizer regexes (PCRE2), GPT-2 byte<->unicode table,
// merge ranks. Loading from GGUF / tokenizer.json lives in tokenizer_load.cpp.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <queue>

#include <fmt/format.h>

#include "core/error.h"
#include "model/tokenizer_impl.h"

namespace oscar::model {

namespace detail {

const ByteTable& byte_table() {
  static const ByteTable t = [] {
    ByteTable bt;
    std::vector<int> bs;
    for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
    for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
    for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
    std::vector<int> cs = bs;
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      if (std::find(bs.begin(), bs.end(), b) == bs.end()) {
        bs.push_back(b);
        cs.push_back(256 + n);
        ++n;
      }
    }
    bt.cp_to_byte.assign(512, -1);
    for (size_t i = 0; i < bs.size(); ++i) {
      bt.byte_to_utf8[static_cast<size_t>(bs[i])] = utf8_encode(static_cast<uint32_t>(cs[i]));
      bt.cp_to_byte[static_cast<size_t>(cs[i])] = bs[i];
    }
    return bt;
  }();
  return t;
}

std::string utf8_encode(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xF0 | (cp >> 18));
    s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// Length of the UTF-8 sequence starting at s[i] (1 for invalid lead bytes).
size_t utf8_len(std::string_view s, size_t i) {
  const auto c = static_cast<unsigned char>(s[i]);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 1;
  if (i + n > s.size()) return 1;
  for (size_t k = 1; k < n; ++k)
    if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return 1;
  return n;
}

}  // namespace detail

using detail::byte_table;

namespace {

constexpr const char* kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr const char* kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

}  // namespace

std::vector<std::string> pre_regexes_for(const std::string& pre) {
  if (pre == "default" || pre == "gpt2" || pre == "gpt-2") return {kGpt2Regex};
  if (pre == "llama-bpe" || pre == "llama3" || pre == "llama-v3" || pre == "falcon3" ||
      pre == "smaug-bpe" || pre == "dbrx" || pre == "pixtral")
    return {kLlama3Regex};
  if (pre == "qwen2" || pre == "deepseek-r1-qwen") return {kQwen2Regex};
  // SmolLM2's tokenizer.json: Sequence[Digits(individual_digits), ByteLevel(use_regex)].
  if (pre == "smollm" || pre == "starcoder" || pre == "refact" || pre == "codeshell" ||
      pre == "command-r")
    return {R"(\p{N})", kGpt2Regex};
  throw Error(fmt::format("tokenizer: unknown pre-tokenizer '{}'", pre));
}

Tokenizer::Tokenizer() : impl_(std::make_unique<Impl>()) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer::Impl::~Impl() {
  for (void* c : compiled) pcre2_code_free(static_cast<pcre2_code*>(c));
}

void Tokenizer::build() {
  Impl& im = *impl_;
  for (void* c : im.compiled) pcre2_code_free(static_cast<pcre2_code*>(c));
  im.compiled.clear();
  for (const std::string& re : im.regexes) {
    int err = 0;
    PCRE2_SIZE off = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(re.data()), re.size(),
                                     PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &off,
                                     nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR buf[256];
      pcre2_get_error_message(err, buf, sizeof(buf));
      throw Error(fmt::format("{}: pre-tokenizer regex '{}' does not compile at {}: {}", im.source,
                              re, off, reinterpret_cast<const char*>(buf)));
    }
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // optional speed-up; failure is fine
    im.compiled.push_back(code);
  }
  im.vocab.clear();
  im.vocab.reserve(im.tokens.size());
  for (size_t i = 0; i < im.tokens.size(); ++i) im.vocab.emplace(im.tokens[i], static_cast<int>(i));
  // Added tokens are matched longest first; bucket them by first byte.
  im.added_by_byte.assign(256, {});
  for (size_t i = 0; i < im.tokens.size(); ++i) {
    if (!im.added[i] || im.tokens[i].empty()) continue;
    im.added_by_byte[static_cast<unsigned char>(im.tokens[i][0])].push_back(static_cast<int>(i));
  }
  for (auto& v : im.added_by_byte)
    std::sort(v.begin(), v.end(), [&](int a, int b) {
      return im.tokens[static_cast<size_t>(a)].size() > im.tokens[static_cast<size_t>(b)].size();
    });
}

const std::vector<std::string>& Tokenizer::pre_regexes() const { return impl_->regexes; }
int Tokenizer::vocab_size() const { return static_cast<int>(impl_->tokens.size()); }

const std::string& Tokenizer::token_text(int id) const {
  if (id < 0 || id >= vocab_size())
    throw Error(fmt::format("{}: token id {} out of range [0, {})", impl_->source, id, vocab_size()));
  return impl_->tokens[static_cast<size_t>(id)];
}

int Tokenizer::token_id(std::string_view text) const {
  auto it = impl_->vocab.find(std::string(text));
  return it == impl_->vocab.end() ? -1 : it->second;
}

bool Tokenizer::is_eos(int id) const { return std::find(eos_.begin(), eos_.end(), id) != eos_.end(); }

bool Tokenizer::is_special(int id) const {
  return id >= 0 && id < vocab_size() && impl_->special[static_cast<size_t>(id)];
}

namespace {

struct Piece { size_t begin, len; };

// Splits [piece] of `text` by one compiled regex: matches and the gaps
// between them both become pieces (HF "Isolated", llama.cpp's behaviour).
void split_by(pcre2_code* re, pcre2_match_data* md, std::string_view text, Piece p,
              std::vector<Piece>& out) {
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data() + p.begin);
  size_t pos = 0, last = 0;
  while (pos <= p.len) {
    const int rc = pcre2_match(re, subject, p.len, pos, 0, md, nullptr);
    if (rc < 0) break;  // no match (or invalid UTF-8 with no further match)
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t s = ov[0], e = ov[1];
    if (e == s) {  // empty match: step one code point so we always progress
      if (s >= p.len) break;
      pos = s + detail::utf8_len(text.substr(p.begin, p.len), s);
      continue;
    }
    if (s > last) out.push_back({p.begin + last, s - last});
    out.push_back({p.begin + s, e - s});
    last = pos = e;
  }
  if (last < p.len) out.push_back({p.begin + last, p.len - last});
}

}  // namespace

void Tokenizer::bpe(std::string_view piece, std::vector<int>& out) const {
  if (piece.empty()) return;
  const Impl& im = *impl_;
  const auto& bt = byte_table();
  std::string mapped;
  mapped.reserve(piece.size() * 2);
  std::vector<std::string> sym;
  sym.reserve(piece.size());
  for (char c : piece) {
    const std::string& u = bt.byte_to_utf8[static_cast<unsigned char>(c)];
    mapped += u;
    sym.push_back(u);
  }
  if (im.ignore_merges) {
    auto it = im.vocab.find(mapped);
    if (it != im.vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  // Lowest-rank-first merging with a heap over adjacent pairs (O(n log n), as
  // HF tokenizers does; same result as GPT-2's "merge every occurrence of the
  // best pair" loop because a merge's parts always rank before it). Symbols are
  // spans of `mapped`; a merge grows the left span and unlinks the right one.
  const size_t n = sym.size();
  std::vector<size_t> start(n), len(n);
  std::vector<int> prev(n), next(n);
  for (size_t i = 0, off = 0; i < n; ++i) {
    start[i] = off;
    len[i] = sym[i].size();
    off += len[i];
    prev[i] = static_cast<int>(i) - 1;
    next[i] = i + 1 < n ? static_cast<int>(i + 1) : -1;
  }
  struct Cand {
    int rank;
    int left;
    size_t left_len, right_len;  // to detect stale entries
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  std::string key;
  auto push = [&](int l) {
    if (l < 0) return;
    const int r = next[static_cast<size_t>(l)];
    if (r < 0) return;
    const auto lu = static_cast<size_t>(l), ru = static_cast<size_t>(r);
    key.assign(mapped, start[lu], len[lu]).append(1, ' ').append(mapped, start[ru], len[ru]);
    auto it = im.merge_rank.find(key);
    if (it != im.merge_rank.end()) heap.push({it->second, l, len[lu], len[ru]});
  };
  for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int>(i));
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    const auto l = static_cast<size_t>(c.left);
    if (len[l] != c.left_len || next[l] < 0) continue;  // left changed or gone (len 0)
    const auto r = static_cast<size_t>(next[l]);
    if (len[r] != c.right_len) continue;
    len[l] += len[r];
    len[r] = 0;
    next[l] = next[r];
    if (next[r] >= 0) prev[static_cast<size_t>(next[r])] = c.left;
    if (prev[l] >= 0) push(prev[l]);
    push(c.left);
  }
  for (int i = 0; i >= 0; i = next[static_cast<size_t>(i)]) {
    const auto iu = static_cast<size_t>(i);
    auto it = im.vocab.find(mapped.substr(start[iu], len[iu]));
    if (it != im.vocab.end()) {
      out.push_back(it->second);
    } else if (im.unk >= 0) {
      out.push_back(im.unk);
    } else {
      throw Error(fmt::format("{}: byte-level symbol '{}' is not in the vocabulary and there is no "
                              "unknown token", im.source, mapped.substr(start[iu], len[iu])));
    }
  }
}

std::vector<int> Tokenizer::encode(std::string_view text, bool add_special) const {
  const Impl& im = *impl_;
  std::vector<int> out;
  if (add_special && add_bos_ && bos_ >= 0) out.push_back(bos_);
  pcre2_match_data* md = pcre2_match_data_create(4, nullptr);
  struct Guard { pcre2_match_data* m; ~Guard() { pcre2_match_data_free(m); } } guard{md};

  std::string prefixed;
  auto encode_text = [&](std::string_view seg) {
    if (seg.empty()) return;
    std::vector<Piece> pieces{{0, seg.size()}}, next;
    for (void* c : im.compiled) {
      next.clear();
      for (const Piece& p : pieces) split_by(static_cast<pcre2_code*>(c), md, seg, p, next);
      pieces.swap(next);
    }
    for (const Piece& p : pieces) bpe(seg.substr(p.begin, p.len), out);
  };

  size_t seg_start = 0, i = 0;
  bool first = true;
  while (i < text.size()) {
    int match = -1;
    for (int id : im.added_by_byte[static_cast<unsigned char>(text[i])]) {
      const std::string& t = im.tokens[static_cast<size_t>(id)];
      if (text.compare(i, t.size(), t) == 0) {
        match = id;
        break;
      }
    }
    if (match < 0) {
      ++i;
      continue;
    }
    std::string_view seg = text.substr(seg_start, i - seg_start);
    if (first && im.add_prefix_space && !seg.empty() && seg[0] != ' ') {
      prefixed.assign(1, ' ');
      prefixed.append(seg);
      seg = prefixed;
    }
    encode_text(seg);
    first = false;
    out.push_back(match);
    i += im.tokens[static_cast<size_t>(match)].size();
    seg_start = i;
  }
  std::string_view seg = text.substr(seg_start);
  if (first && im.add_prefix_space && !seg.empty() && seg[0] != ' ') {
    prefixed.assign(1, ' ');
    prefixed.append(seg);
    seg = prefixed;
  }
  encode_text(seg);
  return out;
}

std::string Tokenizer::token_str(int id) const {
  const Impl& im = *impl_;
  const std::string& t = token_text(id);
  if (im.added[static_cast<size_t>(id)]) return t;
  const auto& bt = byte_table();
  std::string out;
  out.reserve(t.size());
  for (size_t i = 0; i < t.size();) {
    const size_t n = detail::utf8_len(t, i);
    uint32_t cp = static_cast<unsigned char>(t[i]);
    if (n == 2) cp = ((cp & 0x1F) << 6) | (static_cast<unsigned char>(t[i + 1]) & 0x3F);
    else if (n == 3) cp = ((cp & 0x0F) << 12) | ((static_cast<unsigned char>(t[i + 1]) & 0x3F) << 6) |
                          (static_cast<unsigned char>(t[i + 2]) & 0x3F);
    else if (n == 4) cp = ((cp & 0x07) << 18) | ((static_cast<unsigned char>(t[i + 1]) & 0x3F) << 12) |
                          ((static_cast<unsigned char>(t[i + 2]) & 0x3F) << 6) |
                          (static_cast<unsigned char>(t[i + 3]) & 0x3F);
    if (cp < bt.cp_to_byte.size() && bt.cp_to_byte[cp] >= 0) {
      out += static_cast<char>(bt.cp_to_byte[cp]);
    } else {
      out.append(t, i, n);  // not a byte-level symbol: keep as is
    }
    i += n;
  }
  return out;
}

std::string Tokenizer::decode(const std::vector<int>& ids, bool skip_special) const {
  std::string out;
  for (int id : ids) {
    if (skip_special && is_special(id)) continue;
    out += token_str(id);
  }
  return out;
}

Tokenizer load_tokenizer(const std::string& model_path) {
  namespace fs = std::filesystem;
  if (fs::is_directory(model_path)) return Tokenizer::from_hf(model_path);
  if (fs::path(model_path).filename() == "tokenizer.json") return Tokenizer::from_hf(model_path);
  return Tokenizer::from_gguf(model_path);
}

}  // namespace oscar::model
