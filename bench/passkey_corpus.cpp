// Writes a synthetic passkey-retrieval corpus (the passkey test of Mohtashami & Jaggi 2023, "Landmark
// Attention"): each document is a haystack with a random 5-digit pass key stated once at a random depth, and
// ends with the question and the key, so that the key's last occurrence can only be predicted by looking it up
// in the context. The haystack is one random sentence of the document (words from a fixed list) repeated: a
// model predicts it by copying earlier repeats, which trains the induction heads that retrieval needs, and it
// is compressible (its repeats are near-duplicates in the cache) while the key is not. A model trained on such
// documents with `dcp train` (configs/passkey.yaml) is meant to learn to retrieve (the small ones trained on this
// CPU have not yet: docs/kv_cache.md "Retrieval"); `dcp kv-eval` on documents of a fixed length then measures
// whether a compressed KV cache still lets it (an eviction policy loses a key it did not keep).
//
//   build/bench/passkey_corpus --out DIR --docs 12000 --min-bytes 409 --max-bytes 700 --needles 4 --seed 1
//   build/bench/passkey_corpus --out DIR --docs 64 --min-bytes 517 --max-bytes 517 --needles 4 --seed 2  # eval
//
// Documents are DIR/passkey_NNNNN.txt (data.format text_dir, data.glob "*.txt"). A document of B bytes ends
// with the marker and the 5 key digits: `dcp kv-eval --context B-5 --continuation 5` prefills BOS and the bytes
// before the marker, decodes the marker and scores the digits; `dcp generate` with the first B-5 bytes as the
// prompt should print them.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <random>
#include <vector>
#include <algorithm>
#include <string>

namespace {

const char* const kWords[] = {"the", "grass", "is", "green", "sky", "blue", "sun", "yellow", "here", "we", "go",
                              "there", "and", "back", "again", "a", "river", "runs", "down", "to", "sea", "old",
                              "stone", "bridge", "over", "quiet", "town", "near", "hill", "light", "rain", "falls"};

// The document's haystack sentence: 6 to 12 random words and a full stop.
std::string sentence(std::mt19937_64& rng) {
  std::string out;
  const int words = std::uniform_int_distribution<int>(6, 12)(rng);
  for (int i = 0; i < words; ++i) {
    out += kWords[std::uniform_int_distribution<size_t>(0, std::size(kWords) - 1)(rng)];
    out += i + 1 < words ? " " : ". ";
  }
  out[0] = static_cast<char>(out[0] - 'a' + 'A');
  return out;
}

// `n` bytes of `text` repeated, starting at byte `offset` of it.
std::string repeat(const std::string& text, size_t offset, size_t n) {
  std::string out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) out += text[(offset + i) % text.size()];
  return out;
}

// Needle k's key follows kMarkers[k], a byte found nowhere else in the document, so a head that matches one
// previous token finds it. Without markers (the first corpora) the key followed "is ", which the haystack's words
// repeat, and the small models trained on this CPU never learned the longer match that needs (docs/kv_cache.md).
constexpr char kMarkers[] = "#$%&@*+=";
constexpr int kMaxNeedles = sizeof(kMarkers) - 1;

// A document of exactly `bytes` bytes: the haystack with `needles` keys stated at random depths, then one
// question per key in random order, the last one for the key after '#'. bytes >= 160 + 83 x (needles - 1).
std::string document(std::mt19937_64& rng, size_t bytes, int needles) {
  std::vector<std::string> stated, asked;
  size_t used = 0;
  for (int k = 0; k < needles; ++k) {
    const std::string key = fmt::format("{:05d}", std::uniform_int_distribution<int>(0, 99999)(rng));
    stated.push_back(fmt::format(" The pass key is {}{}. Remember it. ", kMarkers[k], key));
    asked.push_back(fmt::format(" What is the pass key? The pass key is {}{}", kMarkers[k], key));
    used += stated.back().size() + asked.back().size();
  }
  std::shuffle(asked.begin() + 1, asked.end(), rng);
  std::rotate(asked.begin(), asked.begin() + 1, asked.end());  // '#' last: the continuation dcp kv-eval scores
  const size_t hay = bytes - used;
  std::vector<size_t> depth;
  for (int k = 0; k < needles; ++k) depth.push_back(std::uniform_int_distribution<size_t>(0, hay)(rng));
  std::sort(depth.begin(), depth.end());
  const std::string hay_text = sentence(rng);
  std::string text;
  size_t at = 0;
  for (int k = 0; k < needles; ++k) {
    text += repeat(hay_text, at, depth[k] - at) + stated[k];
    at = depth[k];
  }
  text += repeat(hay_text, at, hay - at);
  for (const auto& q : asked) text += q;
  return text;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Write a synthetic passkey-retrieval corpus (text files) for dcp train and dcp kv-eval");
  std::string out;
  int64_t docs = 1000, min_bytes = 256, max_bytes = 2048;
  uint64_t seed = 1;
  int64_t needles = 1;
  app.add_option("--out", out, "folder to write (created; existing passkey_*.txt files are overwritten)")->required();
  app.add_option("--docs", docs, "documents")->check(CLI::Range(int64_t{1}, int64_t{10000000}));
  app.add_option("--min-bytes", min_bytes, "shortest document, bytes")->check(CLI::Range(int64_t{160}, int64_t{1} << 30));
  app.add_option("--max-bytes", max_bytes, "longest document, bytes")->check(CLI::Range(int64_t{160}, int64_t{1} << 30));
  app.add_option("--needles", needles, "keys per document (more keys = more retrieval per training token)")
      ->check(CLI::Range(int64_t{1}, int64_t{kMaxNeedles}));
  app.add_option("--seed", seed, "random seed (use different seeds for training and evaluation)");
  CLI11_PARSE(app, argc, argv);
  if (min_bytes > max_bytes) {
    fmt::print(stderr, "passkey_corpus: --min-bytes {} exceeds --max-bytes {}\n", min_bytes, max_bytes);
    return 2;
  }
  if (min_bytes < 160 + 83 * (needles - 1)) {
    fmt::print(stderr, "passkey_corpus: --min-bytes {} is too short for {} needles (needs {})\n", min_bytes,
               needles, 160 + 83 * (needles - 1));
    return 2;
  }
  std::error_code ec;
  std::filesystem::create_directories(out, ec);
  if (ec) {
    fmt::print(stderr, "passkey_corpus: cannot create {}: {}\n", out, ec.message());
    return 1;
  }
  std::mt19937_64 rng(seed);
  for (int64_t d = 0; d < docs; ++d) {
    const auto bytes = static_cast<size_t>(std::uniform_int_distribution<int64_t>(min_bytes, max_bytes)(rng));
    const std::string text = document(rng, bytes, static_cast<int>(needles));
    const std::string path = fmt::format("{}/passkey_{:05d}.txt", out, d);
    std::FILE* f = std::fopen(path.c_str(), "wb");
    const bool written = f != nullptr && std::fwrite(text.data(), 1, text.size(), f) == text.size();
    if (f == nullptr || std::fclose(f) != 0 || !written) {
      fmt::print(stderr, "passkey_corpus: cannot write {}: {}\n", path, std::strerror(errno));
      return 1;
    }
  }
  fmt::print("wrote {} documents to {}\n", docs, out);
  return 0;
}
