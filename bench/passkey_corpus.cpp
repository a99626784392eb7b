// Writes a synthetic passkey-retrieval corpus (the passkey test of Mohtashami & Jaggi 2023, "Landmark
// Attention", in the dense multi-key form of the associative-recall tasks, Arora et al. 2023, "Zoology"): each
// document is a haystack with up to 8 random 5-digit keys, each stated once at a random depth right after its own
// marker byte, and ends with the markers again, in random order, each followed by its key, the one after '#'
// last. A key's second occurrence can only be predicted by finding its marker earlier in the context: the
// one-token match of an induction head (Olsson et al. 2022). The haystack is one random segment of the document
// (random letters) repeated: a model predicts it by copying earlier repeats (meant to train the same heads; the
// models trained on this CPU learned the copy but not the retrieval), and it is compressible (its repeats are near-duplicates in the cache) while the keys are not. A model trained on
// such documents with `dcp train` (configs/passkey.yaml) retrieves or not (docs/kv_cache.md "Retrieval");
// `dcp kv-eval` on documents of a fixed length then measures whether a compressed KV cache still lets it (an
// eviction policy loses a key it did not keep).
//
//   build/bench/passkey_corpus --out DIR --docs 100000 --min-bytes 300 --max-bytes 690 --needles 8 --seed 1
//   build/bench/passkey_corpus --out DIR --docs 64 --min-bytes 517 --max-bytes 517 --needles 8 --seed 2  # eval
//
// Documents are DIR/passkey_NNNNN.txt (data.format text_dir, data.glob "*.txt"). A document of B bytes ends
// with the marker '#' and its 5 key digits: `dcp kv-eval --context B-5 --continuation 5` prefills BOS and the
// bytes before the marker, decodes the marker and scores the digits; `dcp generate` with the first B-5 bytes as
// the prompt should print them.
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

// The document's haystack segment: 12 to 24 random lowercase letters and a full stop. Random letters, not words:
// a segment's repeats are then predictable only by copying from an earlier occurrence, where a sentence of common
// words was mostly predictable from within-word letter statistics. The copy can also be learned as "one period
// back", which does not find a marker seen once (docs/kv_cache.md "Retrieval").
std::string segment(std::mt19937_64& rng) {
  std::string out;
  const int letters = std::uniform_int_distribution<int>(12, 24)(rng);
  for (int i = 0; i < letters; ++i) out += static_cast<char>('a' + std::uniform_int_distribution<int>(0, 25)(rng));
  return out + ". ";
}

// `n` bytes of `text` repeated, starting at byte `offset` of it.
std::string repeat(const std::string& text, size_t offset, size_t n) {
  std::string out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) out += text[(offset + i) % text.size()];
  return out;
}

// Needle k's key follows kMarkers[k], a byte found nowhere else in the document, so a head that matches one
// previous token finds it. The earlier corpora wrapped keys in "The pass key is ..." and asked "What is the pass
// key? The pass key is ...": with several keys, that shared text matched every statement equally, and the small
// models trained on this CPU never retrieved (docs/kv_cache.md "Retrieval").
constexpr char kMarkers[] = "#$%&@*+=";
constexpr int kMaxNeedles = sizeof(kMarkers) - 1;
// The shortest haystack: room for the segment (at most 26 bytes) at least three times.
constexpr int64_t kMinHaystack = 80;

// A document of exactly `bytes` bytes: the haystack with `needles` keys stated at random depths, then one
// question per key in random order, the last one for the key after '#'. bytes >= kMinHaystack + 15 x needles.
std::string document(std::mt19937_64& rng, size_t bytes, int needles) {
  std::vector<std::string> stated, asked;
  size_t used = 0;
  for (int k = 0; k < needles; ++k) {
    const std::string key = fmt::format("{:05d}", std::uniform_int_distribution<int>(0, 99999)(rng));
    stated.push_back(fmt::format(" {}{} ", kMarkers[k], key));
    asked.push_back(fmt::format(" {}{}", kMarkers[k], key));
    used += stated.back().size() + asked.back().size();
  }
  std::shuffle(asked.begin() + 1, asked.end(), rng);
  std::rotate(asked.begin(), asked.begin() + 1, asked.end());  // '#' last: the continuation dcp kv-eval scores
  const size_t hay = bytes - used;
  std::vector<size_t> depth;
  for (int k = 0; k < needles; ++k) depth.push_back(std::uniform_int_distribution<size_t>(0, hay)(rng));
  std::sort(depth.begin(), depth.end());
  const std::string hay_text = segment(rng);
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
  app.add_option("--min-bytes", min_bytes, "shortest document, bytes")
      ->check(CLI::Range(kMinHaystack + 15, int64_t{1} << 30));
  app.add_option("--max-bytes", max_bytes, "longest document, bytes")
      ->check(CLI::Range(kMinHaystack + 15, int64_t{1} << 30));
  app.add_option("--needles", needles, "keys per document (more keys = more retrieval per training token)")
      ->check(CLI::Range(int64_t{1}, int64_t{kMaxNeedles}));
  app.add_option("--seed", seed, "random seed (use different seeds for training and evaluation)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {  // usage errors exit 2, as dcp's own (--help exits 0)
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (min_bytes > max_bytes) {
    fmt::print(stderr, "passkey_corpus: --min-bytes {} exceeds --max-bytes {}\n", min_bytes, max_bytes);
    return 2;
  }
  if (min_bytes < kMinHaystack + 15 * needles) {
    fmt::print(stderr, "passkey_corpus: --min-bytes {} is too short for {} needles (needs {})\n", min_bytes,
               needles, kMinHaystack + 15 * needles);
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
