// Writes a synthetic passkey-retrieval corpus (the passkey test of Mohtashami & Jaggi 2023, "Landmark
// Attention"): each document is a haystack with a random 5-digit pass key stated once at a random depth, and
// ends with the question and the key, so that the key's last occurrence can only be predicted by looking it up
// in the context. The haystack is one random sentence of the document (words from a fixed list) repeated: a
// model predicts it by copying earlier repeats, which trains the induction heads that retrieval needs, and it
// is compressible (its repeats are near-duplicates in the cache) while the key is not. A model trained on such
// documents with `dcp train` (configs/passkey.yaml) learns to retrieve; `dcp kv-eval` on documents of a fixed
// length then measures whether a compressed KV cache still lets it (an eviction policy loses a key it did not
// keep).
//
//   build/bench/passkey_corpus --out DIR --docs 6000 --min-bytes 200 --max-bytes 1100 --seed 1
//   build/bench/passkey_corpus --out DIR --docs 64 --min-bytes 1029 --max-bytes 1029 --seed 2   # eval, C=1024
//
// Documents are DIR/passkey_NNNNN.txt (data.format text_dir, data.glob "*.txt"). A document of B bytes ends
// with the 5 key digits: with dcp's BOS token first, a context of B - 4 tokens ends just before them.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <random>
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Write a synthetic passkey-retrieval corpus (text files) for dcp train and dcp kv-eval");
  std::string out;
  int64_t docs = 1000, min_bytes = 256, max_bytes = 2048;
  uint64_t seed = 1;
  app.add_option("--out", out, "folder to write (created; existing passkey_*.txt files are overwritten)")->required();
  app.add_option("--docs", docs, "documents")->check(CLI::Range(int64_t{1}, int64_t{10000000}));
  app.add_option("--min-bytes", min_bytes, "shortest document, bytes")->check(CLI::Range(int64_t{160}, int64_t{1} << 30));
  app.add_option("--max-bytes", max_bytes, "longest document, bytes")->check(CLI::Range(int64_t{160}, int64_t{1} << 30));
  app.add_option("--seed", seed, "random seed (use different seeds for training and evaluation)");
  CLI11_PARSE(app, argc, argv);
  if (min_bytes > max_bytes) {
    fmt::print(stderr, "passkey_corpus: --min-bytes {} exceeds --max-bytes {}\n", min_bytes, max_bytes);
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
    const std::string key = fmt::format("{:05d}", std::uniform_int_distribution<int>(0, 99999)(rng));
    const std::string needle = " The pass key is " + key + ". Remember it. " + key + " is the pass key. ";
    const std::string question = " What is the pass key? The pass key is " + key;
    const size_t hay = bytes - needle.size() - question.size();  // >= 160 - 111 bytes of haystack
    const size_t before = std::uniform_int_distribution<size_t>(0, hay)(rng);
    const std::string hay_text = sentence(rng);
    const std::string text = repeat(hay_text, 0, before) + needle + repeat(hay_text, before, hay - before) + question;
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
