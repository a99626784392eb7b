// Writes the synthetic key-value retrieval corpus of `dcp kv-eval`'s retrieval task (docs/kv_cache.md
// "Retrieval"): multi-query associative recall (MQAR, Arora et al. 2023, "Zoology", section 3) in bytes, with a
// filler haystack. A document states `pairs` key-value pairs, each an uppercase key (distinct within the
// document) directly followed by a lowercase value, at random depths in runs of '.', then '|', then every key
// again in random order, each followed by its value:
//
//   ..Qa.....Bx.Ce...|BxQaCe
//
// A value after '|' is predictable only by finding its key earlier and copying the byte that followed it, the
// one-token match of an induction head (Olsson et al. 2022); nothing else in the document tells it. The filler
// is the compressible part of a KV cache (runs of one byte: entries that differ only by position), the pairs the
// incompressible part: evicting a pair's entries loses that value for good.
//
// Why this form (earlier corpora, docs/kv_cache.md "Retrieval"): keys wrapped in shared text ("The pass key
// is ...") or a haystack of a repeated random segment left the small models of this CPU at chance after up to
// 193M training tokens; dense single-byte pairs, asked many times per document, put about 10% of the training
// targets on retrieval, and a model trained on them (configs/recall.yaml) retrieves.
//
//   build/bench/recall_corpus --out runs/recall_corpus/train.jsonl --docs 400000 --min-pairs 1 --max-pairs 24 \
//       --min-filler 0 --max-filler 160 --seed 5
//   build/bench/recall_corpus --out runs/recall_corpus/eval.jsonl --docs 512 --min-pairs 20 --max-pairs 20 \
//       --min-filler 150 --max-filler 150 --seed 6   # 231 bytes each
//
// A natural-text haystack (--haystack text --haystack-path DIR): the filler is a span of real text (the files of
// DIR, concatenated in name order; e.g. the CPython documentation sources), lowercased and with '|' removed, so
// that an uppercase byte is always a key and '|' always the question mark: the haystack is then compressible only
// the way text is (not by identical bytes), and every key must still be found among real words. Each document
// takes its span at a random offset.
//
// The output is a JSON-lines file of {"text": ...} (data.format jsonl). A document of P pairs and F filler bytes
// has 4P + F + 1 bytes and ends with its last key and value: `dcp kv-eval --context B-1 --continuation 1`
// prefills BOS and every byte before that key (the other P - 1 questions included), decodes the key through the
// compressed cache and scores the value, so top-1 accuracy (`exact_match`) is retrieval accuracy.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr int kKeys = 26;  // 'A'..'Z': keys are distinct within a document
constexpr char kFiller = '.';
constexpr char kQuestions = '|';

// Where the filler comes from: runs of '.' (empty text), or spans of `text` (lowercased, no '|').
struct Haystack {
  std::string text;
  std::string span(std::mt19937_64& rng, int64_t n) const {
    if (text.empty()) return std::string(static_cast<size_t>(n), kFiller);
    std::uniform_int_distribution<size_t> at(0, text.size() - static_cast<size_t>(n));
    return text.substr(at(rng), static_cast<size_t>(n));
  }
};

// The haystack text of the regular files under `dir` (every file, name order), lowercased ASCII, '|' removed,
// control bytes and non-ASCII bytes turned into spaces, runs of whitespace kept. Empty when nothing is read.
std::string haystack_text(const std::string& dir) {
  std::vector<std::filesystem::path> files;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    if (it->is_regular_file(ec)) files.push_back(it->path());
  }
  std::sort(files.begin(), files.end());
  std::string text;
  for (const auto& f : files) {
    std::FILE* in = std::fopen(f.c_str(), "rb");
    if (in == nullptr) continue;
    char buf[65536];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, in)) > 0;) {
      for (size_t i = 0; i < n; ++i) {
        const auto c = static_cast<unsigned char>(buf[i]);
        if (c == static_cast<unsigned char>(kQuestions)) continue;
        if (c == '\n' || c == ' ') {
          text.push_back(static_cast<char>(c));
        } else if (c < 32 || c >= 127) {
          text.push_back(' ');
        } else {
          text.push_back(static_cast<char>(std::tolower(c)));
        }
      }
    }
    std::fclose(in);
  }
  return text;
}

// One document: `pairs` pairs with `filler` bytes of filler cut at random points between them, then the questions.
std::string document(std::mt19937_64& rng, int pairs, int64_t filler, const Haystack& haystack) {
  std::vector<char> keys(kKeys);
  std::iota(keys.begin(), keys.end(), 'A');
  std::shuffle(keys.begin(), keys.end(), rng);
  keys.resize(static_cast<size_t>(pairs));
  std::vector<char> values;
  std::uniform_int_distribution<int> letter(0, 25);
  for (int i = 0; i < pairs; ++i) values.push_back(static_cast<char>('a' + letter(rng)));
  std::vector<int64_t> cuts;
  std::uniform_int_distribution<int64_t> cut(0, filler);
  for (int i = 0; i < pairs; ++i) cuts.push_back(cut(rng));
  std::sort(cuts.begin(), cuts.end());
  cuts.push_back(filler);
  std::string text;
  const std::string hay = haystack.span(rng, filler);
  int64_t at = 0;
  for (int i = 0; i <= pairs; ++i) {
    text.append(hay, static_cast<size_t>(at), static_cast<size_t>(cuts[static_cast<size_t>(i)] - at));
    at = cuts[static_cast<size_t>(i)];
    if (i < pairs) text += {keys[static_cast<size_t>(i)], values[static_cast<size_t>(i)]};
  }
  text += kQuestions;
  std::vector<size_t> order(static_cast<size_t>(pairs));
  std::iota(order.begin(), order.end(), size_t{0});
  std::shuffle(order.begin(), order.end(), rng);
  for (size_t i : order) text += {keys[i], values[i]};
  return text;
}

// The temporary file of a run in progress, removed when SIGINT or SIGTERM stops the run (unlink is
// async-signal-safe); empty otherwise.
char g_tmp[4096] = "";

void remove_tmp_and_die(int sig) {
  if (g_tmp[0] != '\0') unlink(g_tmp);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

// --seed: a decimal unsigned 64-bit number, whole (CLI11 wraps "-1" and saturates values beyond 2^64 - 1).
std::string seed_error(const std::string& text) {
  errno = 0;
  char* end = nullptr;
  std::strtoull(text.c_str(), &end, 10);
  const bool ok = !text.empty() && text.find_first_not_of("0123456789") == std::string::npos && errno != ERANGE;
  return ok ? std::string() : "must be a whole number in [0, 18446744073709551615]";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("Write a synthetic key-value retrieval corpus (JSON lines) for dcp train and dcp kv-eval");
  std::string out;
  int64_t docs = 1000, min_pairs = 8, max_pairs = 24, min_filler = 0, max_filler = 160;
  uint64_t seed = 1;
  std::string haystack_kind = "dots", haystack_path;
  app.add_option("--out", out, "JSON-lines file to write (a new or regular file, replaced only once every document "
                               "is written)")
      ->required()
      ->check(CLI::Validator([](std::string& v) { return v.empty() ? std::string("must not be empty") : ""; }, "PATH"));
  app.add_option("--docs", docs, "documents")->check(CLI::Range(int64_t{1}, int64_t{100000000}));
  app.add_option("--min-pairs", min_pairs, "fewest key-value pairs per document")
      ->check(CLI::Range(int64_t{1}, int64_t{kKeys}));
  app.add_option("--max-pairs", max_pairs, "most key-value pairs per document")
      ->check(CLI::Range(int64_t{1}, int64_t{kKeys}));
  app.add_option("--min-filler", min_filler, "fewest filler bytes per document")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  app.add_option("--max-filler", max_filler, "most filler bytes per document")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  app.add_option("--seed", seed, "random seed (use different seeds for training and evaluation)")
      ->check(CLI::Validator([](std::string& v) { return seed_error(v); }, "UINT64"));
  app.add_option("--haystack", haystack_kind, "the filler: dots (runs of '.') or text (spans of --haystack-path)")
      ->check(CLI::IsMember({"dots", "text"}));
  app.add_option("--haystack-path", haystack_path, "with --haystack text: a folder whose files are the text");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {  // usage errors exit 2, as dcp's own (--help exits 0)
    return app.exit(e) == 0 ? 0 : 2;
  }
  Haystack haystack;
  if (haystack_kind == "text") {
    if (haystack_path.empty()) {
      fmt::print(stderr, "recall_corpus: --haystack text needs --haystack-path\n");
      return 2;
    }
    haystack.text = haystack_text(haystack_path);
    if (static_cast<int64_t>(haystack.text.size()) < max_filler + 1) {
      fmt::print(stderr, "recall_corpus: --haystack-path {} holds {} bytes of text, fewer than --max-filler {} + 1\n",
                 haystack_path, haystack.text.size(), max_filler);
      return 2;
    }
  } else if (!haystack_path.empty()) {
    fmt::print(stderr, "recall_corpus: --haystack-path needs --haystack text\n");
    return 2;
  }
  if (min_pairs > max_pairs || min_filler > max_filler) {
    fmt::print(stderr, "recall_corpus: --min-{0} {1} exceeds --max-{0} {2}\n", min_pairs > max_pairs ? "pairs" : "filler",
               min_pairs > max_pairs ? min_pairs : min_filler, min_pairs > max_pairs ? max_pairs : max_filler);
    return 2;
  }
  // Replacing by rename would turn a device into a file or a link into a copy: only new or regular files.
  std::error_code ec;
  const auto status = std::filesystem::symlink_status(out, ec);
  if (!ec && std::filesystem::exists(status) && !std::filesystem::is_regular_file(status)) {
    fmt::print(stderr, "recall_corpus: --out {} exists and is not a regular file\n", out);
    return 2;
  }
  // A temporary file of its own beside the target, renamed at the end: a failed or interrupted run leaves
  // neither a partial corpus nor someone else's file touched. SIGXFSZ (a file size limit) becomes a write error.
  std::string tmp = out + ".XXXXXX";
  if (tmp.size() >= sizeof g_tmp) {
    fmt::print(stderr, "recall_corpus: --out {} is too long\n", out);
    return 2;
  }
  const int fd = mkstemp(tmp.data());
  std::FILE* f = fd < 0 ? nullptr : fdopen(fd, "wb");
  if (f == nullptr) {
    fmt::print(stderr, "recall_corpus: cannot write {}: {}\n", out, std::strerror(errno));
    if (fd >= 0) unlink(tmp.c_str());
    return 1;
  }
  std::snprintf(g_tmp, sizeof g_tmp, "%s", tmp.c_str());
  std::signal(SIGINT, remove_tmp_and_die);
  std::signal(SIGTERM, remove_tmp_and_die);
  std::signal(SIGXFSZ, SIG_IGN);
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> pairs(min_pairs, max_pairs), filler(min_filler, max_filler);
  int64_t bytes = 0;
  bool written = true;
  int error = 0;
  for (int64_t d = 0; d < docs && written; ++d) {
    const int p = static_cast<int>(pairs(rng));
    const std::string text = document(rng, p, filler(rng), haystack);
    bytes += static_cast<int64_t>(text.size());
    const std::string line = nlohmann::json{{"text", text}}.dump() + "\n";
    written = std::fwrite(line.data(), 1, line.size(), f) == line.size();
    if (!written) error = errno;
  }
  if (std::fclose(f) != 0 && written) error = errno, written = false;
  // mkstemp creates the file 0600; a corpus is readable as any file the user writes.
  const mode_t mask = umask(0);
  umask(mask);
  if (written && chmod(tmp.c_str(), 0666 & ~mask) != 0) error = errno, written = false;
  if (written && std::rename(tmp.c_str(), out.c_str()) != 0) error = errno, written = false;
  if (!written) {
    fmt::print(stderr, "recall_corpus: cannot write {}: {}\n", out, std::strerror(error));
    unlink(tmp.c_str());
    return 1;
  }
  g_tmp[0] = '\0';
  fmt::print("wrote {} documents ({} bytes of text) to {}\n", docs, bytes, out);
  return 0;
}
