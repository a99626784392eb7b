#include <gtest/gtest.h>

#include "unit/error_of.h"
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <stdexcept>

#include "dcp/data.h"
#include "util/hash.h"

using namespace dcp;
namespace fs = std::filesystem;

using dcp::test::error_of;

namespace {

// A fresh folder under the system temp dir, removed with everything in it when the test ends.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() /
            ("dcp_test_corpus_" + std::to_string(::getpid()) + "_" + std::to_string(counter++) + "_" +
             std::to_string(std::random_device{}()));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const fs::path& path() const { return path_; }

  fs::path write(const std::string& rel, const std::string& content) const {
    const fs::path p = path_ / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << content;
    return p;
  }

 private:
  fs::path path_;
};

DataConfig config_for(const fs::path& path, int64_t max_seq_len = 1024, double heldout_fraction = 0.0) {
  DataConfig cfg;
  cfg.path = path.string();
  cfg.max_seq_len = max_seq_len;
  cfg.heldout_fraction = heldout_fraction;
  return cfg;
}

std::set<std::string> sources(const Corpus& c) {
  std::set<std::string> s;
  for (const auto& x : c.samples()) s.insert(x.source);
  return s;
}

std::set<std::string> heldout_sources(const Corpus& c) {
  std::set<std::string> s;
  for (auto id : c.heldout_ids()) s.insert(c.samples()[static_cast<size_t>(id)].source);
  return s;
}

}  // namespace

TEST(CorpusHash, Fnv1a64KnownVectors) {
  EXPECT_EQ(fnv1a64(""), 0xcbf29ce484222325ULL);
  EXPECT_EQ(fnv1a64("a"), 0xaf63dc4c8601ec8cULL);
  EXPECT_EQ(fnv1a64("foobar"), 0x85944171f73967e8ULL);
}

TEST(CorpusHash, Fnv1a64FedInPiecesEqualsTheWhole) {
  EXPECT_EQ(Fnv1a64().value(), fnv1a64(""));
  EXPECT_EQ(Fnv1a64().update("foo").update(nullptr, 0).update("bar").value(), 0x85944171f73967e8ULL);
  const float x[2] = {1.5f, -2.0f};
  std::string bytes(reinterpret_cast<const char*>(x), sizeof(x));
  EXPECT_EQ(Fnv1a64().update("w:2|").update(x, sizeof(x)).value(), fnv1a64("w:2|" + bytes));
  EXPECT_NE(Fnv1a64().update("ab").value(), Fnv1a64().update("ba").value());
}

TEST(CorpusSampleSeed, DeterministicAndDiffersInEachArgument) {
  const uint64_t base = sample_seed(1234, 3, 77);
  EXPECT_EQ(base, sample_seed(1234, 3, 77));
  EXPECT_NE(base, sample_seed(1235, 3, 77));
  EXPECT_NE(base, sample_seed(1234, 4, 77));
  EXPECT_NE(base, sample_seed(1234, 3, 78));
  EXPECT_NE(sample_seed(1, 2, 0), sample_seed(2, 1, 0));
  EXPECT_NE(sample_seed(0, 0, 1), sample_seed(0, 1, 0));

  std::set<uint64_t> seen;
  for (uint64_t s = 0; s < 4; ++s)
    for (uint64_t e = 0; e < 4; ++e)
      for (uint64_t id = 0; id < 64; ++id) seen.insert(sample_seed(s, e, id));
  EXPECT_EQ(seen.size(), 4u * 4u * 64u);
}

TEST(CorpusClassify, EmptyBinaryAndUtf8) {
  EXPECT_EQ(classify_document(""), "empty");
  EXPECT_EQ(classify_document("plain text\n"), "");
  EXPECT_EQ(classify_document("h\xc3\xa9llo \xe2\x82\xac \xf0\x9d\x84\x9e"), "");  // é, €, U+1D11E
  EXPECT_EQ(classify_document(std::string("a\0b", 3)), "binary");
  EXPECT_EQ(classify_document("\xff"), "binary");
  EXPECT_EQ(classify_document("\x80"), "binary");               // lone continuation byte
  EXPECT_EQ(classify_document("\xc0\xaf"), "binary");           // overlong '/'
  EXPECT_EQ(classify_document("\xe0\x80\xaf"), "binary");       // overlong '/'
  EXPECT_EQ(classify_document("\xed\xa0\x80"), "binary");       // surrogate U+D800
  EXPECT_EQ(classify_document("\xf4\x90\x80\x80"), "binary");   // above U+10FFFF
  EXPECT_EQ(classify_document("ok \xe2\x82"), "binary");        // truncated at the end
  EXPECT_EQ(classify_document("\xe2\x82x"), "binary");          // truncated in the middle
}

TEST(CorpusTextDir, RecursiveWalkWithGlobInSortedOrder) {
  TempDir d;
  d.write("b.txt", "bravo");
  d.write("a.txt", "alpha");
  d.write("sub/deeper/c.txt", "charlie");
  d.write("sub/notes.md", "not matched");
  d.write("sub/d.txt.bak", "not matched");
  auto cfg = config_for(d.path());
  cfg.format = "text_dir";

  const Corpus c = Corpus::load(cfg);
  EXPECT_EQ(c.num_documents(), 3);
  EXPECT_EQ(c.skipped().total(), 0);
  ASSERT_EQ(c.samples().size(), 3u);
  const std::string root = d.path().string();
  EXPECT_EQ(c.samples()[0].source, root + "/a.txt#0");
  EXPECT_EQ(c.samples()[1].source, root + "/b.txt#0");
  EXPECT_EQ(c.samples()[2].source, root + "/sub/deeper/c.txt#0");
  EXPECT_EQ(c.bytes(0), "alpha");
  EXPECT_EQ(c.bytes(2), "charlie");
  EXPECT_EQ(c.train_ids(), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_TRUE(c.heldout_ids().empty());

  cfg.glob = "*.md";
  const Corpus md = Corpus::load(cfg);
  ASSERT_EQ(md.samples().size(), 1u);
  EXPECT_EQ(md.bytes(0), "not matched");
}

TEST(CorpusTextDir, SkipsCountedByReason) {
  TempDir d;
  d.write("good.txt", "fine text");
  d.write("empty.txt", "");
  d.write("nul.txt", std::string("ab\0cd", 5));
  d.write("latin1.txt", "caf\xe9");
  // Matches the glob but is no readable file: a dangling symlink and a FIFO (which must not be opened:
  // opening a FIFO with no writer blocks).
  fs::create_symlink(d.path() / "missing-target", d.path() / "dangling.txt");
  ASSERT_EQ(::mkfifo((d.path() / "pipe.txt").c_str(), 0600), 0);
  // A folder whose name matches the glob is walked into, not read as a document.
  d.write("folder.txt/inner.txt", "inner");
  // A symlink loop must neither hang nor read a file twice.
  fs::create_directory_symlink(d.path(), d.path() / "loop");

  const Corpus c = Corpus::load(config_for(d.path()));
  EXPECT_EQ(c.num_documents(), 2);
  EXPECT_EQ(sources(c), (std::set<std::string>{(d.path() / "folder.txt/inner.txt").string() + "#0",
                                               (d.path() / "good.txt").string() + "#0"}));
  const auto& by = c.skipped().by_reason;
  EXPECT_EQ(by.at("empty"), 1);
  EXPECT_EQ(by.at("binary"), 2);
  EXPECT_EQ(by.at("unreadable"), 2);
  EXPECT_EQ(by.size(), 3u);
  EXPECT_EQ(c.skipped().total(), 5);
  EXPECT_EQ(c.skipped().examples.at("unreadable"),
            (std::vector<std::string>{(d.path() / "dangling.txt").string(), (d.path() / "pipe.txt").string()}));
  EXPECT_EQ(c.skipped().examples.at("binary"),
            (std::vector<std::string>{(d.path() / "latin1.txt").string(), (d.path() / "nul.txt").string()}));
}

TEST(CorpusSkipReport, KeepsAtMostThreeExamples) {
  SkipReport r;
  for (int i = 0; i < 5; ++i) r.add("empty", "e" + std::to_string(i));
  r.add("binary", "b");
  EXPECT_EQ(r.total(), 6);
  EXPECT_EQ(r.by_reason.at("empty"), 5);
  EXPECT_EQ(r.examples.at("empty"), (std::vector<std::string>{"e0", "e1", "e2"}));
}

TEST(CorpusJsonl, LinesParsedAndSkipsCounted) {
  TempDir d;
  const fs::path p = d.write("docs.jsonl",
                             "{\"text\": \"first\"}\n"          // 1
                             "\n"                                // 2: blank, ignored
                             "{not json\n"                       // 3
                             "{\"body\": \"no text\"}\n"         // 4
                             "{\"text\": 5}\n"                   // 5
                             "[\"text\"]\n"                      // 6
                             "{\"text\": \"\"}\n"                // 7
                             "{\"text\": \"a\\u0000b\"}\n"       // 8
                             "   \t\r\n"                         // 9: blank, ignored
                             "{\"text\": \"last\", \"id\": 3}\r\n"  // 10: CRLF
                             "{\"text\": \"no newline\"}");      // 11
  const Corpus c = Corpus::load(config_for(p));
  const std::string path = p.string();
  ASSERT_EQ(c.samples().size(), 3u);
  EXPECT_EQ(c.samples()[0].source, path + ":1#0");
  EXPECT_EQ(c.samples()[1].source, path + ":10#0");
  EXPECT_EQ(c.samples()[2].source, path + ":11#0");
  EXPECT_EQ(c.bytes(0), "first");
  EXPECT_EQ(c.bytes(1), "last");
  EXPECT_EQ(c.bytes(2), "no newline");
  const auto& by = c.skipped().by_reason;
  EXPECT_EQ(by.at("jsonl_bad_line"), 1);
  EXPECT_EQ(by.at("jsonl_no_text"), 3);
  EXPECT_EQ(by.at("empty"), 1);
  EXPECT_EQ(by.at("binary"), 1);
  EXPECT_EQ(c.skipped().examples.at("jsonl_bad_line"), (std::vector<std::string>{path + ":3"}));
  EXPECT_EQ(c.skipped().examples.at("jsonl_no_text"),
            (std::vector<std::string>{path + ":4", path + ":5", path + ":6"}));
}

TEST(CorpusJsonl, AutoAcceptsJsonExtensionAndExplicitFormatAnyName) {
  TempDir d;
  const fs::path json = d.write("docs.json", "{\"text\": \"x\"}\n");
  EXPECT_EQ(Corpus::load(config_for(json)).num_documents(), 1);
  auto cfg = config_for(d.write("docs.data", "{\"text\": \"y\"}\n"));
  cfg.format = "jsonl";
  EXPECT_EQ(Corpus::load(cfg).num_documents(), 1);
}

TEST(CorpusChunking, LongDocumentsSplitAndEveryByteOnce) {
  EXPECT_EQ(Corpus::from_documents({{"d", "0123456789"}}, config_for("", 4)).samples().size(), 3u);
  EXPECT_EQ(Corpus::from_documents({{"d", "01234567"}}, config_for("", 4)).samples().size(), 2u);

  std::mt19937 rng(7);
  std::vector<std::pair<std::string, std::string>> docs;
  for (int i = 0; i < 40; ++i) {
    std::string text(1 + rng() % 300, ' ');
    for (auto& ch : text) ch = static_cast<char>('a' + rng() % 26);
    docs.emplace_back("doc" + std::to_string(i), text);
  }
  const int64_t max_len = 37;
  const Corpus c = Corpus::from_documents(docs, config_for("", max_len, 0.3));

  size_t id = 0;
  std::vector<int> in_split(c.samples().size(), 0);
  for (auto x : c.train_ids()) ++in_split[static_cast<size_t>(x)];
  for (auto x : c.heldout_ids()) in_split[static_cast<size_t>(x)] += 2;
  for (const auto& [name, text] : docs) {
    const size_t chunks = (text.size() + max_len - 1) / max_len;
    std::string joined;
    const int split = in_split[id];
    for (size_t k = 0; k < chunks; ++k, ++id) {
      ASSERT_LT(id, c.samples().size());
      const Sample& s = c.samples()[id];
      EXPECT_EQ(s.id, static_cast<int64_t>(id));
      EXPECT_EQ(s.source, name + "#" + std::to_string(k));
      EXPECT_LE(s.length, max_len);
      EXPECT_GE(s.length, 1);
      EXPECT_EQ(c.bytes(s.id).size(), static_cast<size_t>(s.length));
      EXPECT_TRUE(in_split[id] == 1 || in_split[id] == 2) << "sample " << id << " not in exactly one split";
      EXPECT_EQ(in_split[id], split) << "chunks of " << name << " in different splits";
      joined += c.bytes(s.id);
    }
    EXPECT_EQ(joined, text);
  }
  EXPECT_EQ(id, c.samples().size());
  EXPECT_EQ(c.num_documents(), 40);
}

TEST(CorpusTokens, InputsShiftedByBosAndBytesUnsigned) {
  const Corpus c = Corpus::from_documents({{"d", "h\xc3\xa9!"}}, config_for("", 16));
  ASSERT_EQ(c.samples()[0].length, 4);
  std::vector<int64_t> inputs(4), targets(4);
  c.tokens(0, inputs.data(), targets.data());
  EXPECT_EQ(inputs, (std::vector<int64_t>{kBosToken, 'h', 0xC3, 0xA9}));
  EXPECT_EQ(targets, (std::vector<int64_t>{'h', 0xC3, 0xA9, '!'}));

  const Corpus one = Corpus::from_documents({{"d", "xy"}}, config_for("", 1));
  int64_t in = -1, tg = -1;
  one.tokens(1, &in, &tg);
  EXPECT_EQ(in, kBosToken);
  EXPECT_EQ(tg, 'y');
}

TEST(CorpusTokens, UnknownIdThrowsOutOfRange) {
  const Corpus c = Corpus::from_documents({{"d", "abc"}}, config_for("", 16));
  EXPECT_THROW(c.bytes(1), std::out_of_range);
  EXPECT_THROW(c.bytes(-1), std::out_of_range);
  try {
    c.bytes(42);
    FAIL() << "no throw";
  } catch (const std::out_of_range& e) {
    EXPECT_NE(std::string(e.what()).find("42"), std::string::npos) << e.what();
  }
}

TEST(CorpusSplit, DeterministicByHashAndIndependentOfOrder) {
  std::vector<std::pair<std::string, std::string>> docs;
  for (int i = 0; i < 400; ++i) docs.emplace_back("dir/file" + std::to_string(i) + ".txt", "text " + std::to_string(i));
  const double fraction = 0.2;
  const Corpus a = Corpus::from_documents(docs, config_for("", 1024, fraction));
  std::reverse(docs.begin(), docs.end());
  std::shuffle(docs.begin(), docs.end(), std::mt19937(3));
  const Corpus b = Corpus::from_documents(docs, config_for("", 1024, fraction));

  EXPECT_EQ(heldout_sources(a), heldout_sources(b));
  EXPECT_EQ(a.train_ids().size() + a.heldout_ids().size(), a.samples().size());
  EXPECT_GT(a.heldout_ids().size(), 40u);   // ~80 expected
  EXPECT_LT(a.heldout_ids().size(), 120u);
  for (const auto& [name, text] : docs) {
    const bool expect_heldout = static_cast<double>(fnv1a64(name) % 1000000) < fraction * 1e6;
    EXPECT_EQ(heldout_sources(a).count(name + "#0"), expect_heldout ? 1u : 0u) << name;
  }

  EXPECT_TRUE(Corpus::from_documents(docs, config_for("", 1024, 0.0)).heldout_ids().empty());
}

TEST(CorpusErrors, MissingPathNamesPathAndDebianPackageForDefault) {
  const std::string under_default = "/usr/share/doc/python3.11/html/_sources/dcp-no-such-folder";
  const std::string msg = error_of([&] { Corpus::load(config_for(under_default)); });
  EXPECT_NE(msg.find(under_default), std::string::npos) << msg;
  EXPECT_NE(msg.find("python3.11-doc"), std::string::npos) << msg;

  TempDir d;
  const std::string other = (d.path() / "nowhere").string();
  const std::string msg2 = error_of([&] { Corpus::load(config_for(other)); });
  EXPECT_NE(msg2.find(other), std::string::npos) << msg2;
  EXPECT_EQ(msg2.find("python3.11-doc"), std::string::npos) << msg2;
}

TEST(CorpusErrors, FormatThatDoesNotFitThePath) {
  TempDir d;
  const fs::path jsonl = d.write("a.jsonl", "{\"text\": \"x\"}\n");
  const fs::path csv = d.write("a.csv", "x,y\n");

  auto cfg = config_for(jsonl);
  cfg.format = "text_dir";
  std::string msg = error_of([&] { Corpus::load(cfg); });
  EXPECT_NE(msg.find("text_dir"), std::string::npos) << msg;
  EXPECT_NE(msg.find(jsonl.string()), std::string::npos) << msg;

  cfg = config_for(d.path());
  cfg.format = "jsonl";
  msg = error_of([&] { Corpus::load(cfg); });
  EXPECT_NE(msg.find("jsonl"), std::string::npos) << msg;
  EXPECT_NE(msg.find(d.path().string()), std::string::npos) << msg;

  msg = error_of([&] { Corpus::load(config_for(csv)); });
  EXPECT_NE(msg.find(csv.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find(".jsonl"), std::string::npos) << msg;

  cfg = config_for(d.path());
  cfg.format = "parquet";
  msg = error_of([&] { Corpus::load(cfg); });
  EXPECT_NE(msg.find("parquet"), std::string::npos) << msg;
}

TEST(CorpusErrors, NoTrainingSampleNamesPathAndSkipCounts) {
  TempDir d;
  d.write("empty.txt", "");
  d.write("nul.txt", std::string("\0", 1));
  const std::string msg = error_of([&] { Corpus::load(config_for(d.path())); });
  EXPECT_NE(msg.find(d.path().string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("empty=1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("binary=1"), std::string::npos) << msg;

  d.write("only.txt", "kept but held out");
  EXPECT_NE(error_of([&] { Corpus::load(config_for(d.path(), 1024, 1.0)); }), "");
}

TEST(CorpusDefault, LoadsPythonDocs) {
  const DataConfig defaults;
  if (!fs::is_directory(defaults.path)) GTEST_SKIP() << defaults.path << " absent (Debian package python3.11-doc)";
  ASSERT_EQ(defaults.glob, "*.txt");
  ASSERT_DOUBLE_EQ(defaults.heldout_fraction, 0.05);

  const Corpus c = Corpus::load(defaults);
  EXPECT_GE(c.num_documents(), 490);
  EXPECT_LE(c.skipped().total(), 5);
  EXPECT_FALSE(c.heldout_ids().empty());
  EXPECT_FALSE(c.train_ids().empty());
  EXPECT_EQ(c.train_ids().size() + c.heldout_ids().size(), c.samples().size());
  for (const auto& s : c.samples()) {
    ASSERT_GE(s.length, 1);
    ASSERT_LE(s.length, defaults.max_seq_len);
  }
}

TEST(LengthHistogram, PercentilesAndTokenShares) {
  // 10 samples: nine of 100 tokens and one of 5000; nearest-rank p50 = 5th = 100, p90 = 9th = 100.
  std::vector<int64_t> lengths(9, 100);
  lengths.push_back(5000);
  const LengthHistogram h = length_histogram(lengths);
  EXPECT_EQ(h.count, 10);
  EXPECT_EQ(h.tokens, 5900);
  EXPECT_EQ(h.min, 100);
  EXPECT_EQ(h.p50, 100);
  EXPECT_EQ(h.p90, 100);
  EXPECT_EQ(h.max, 5000);
  ASSERT_EQ(h.token_share_above.size(), 13u);  // 1, 2, ..., 4096 (8192 >= max)
  EXPECT_EQ(h.token_share_above.front().first, 1);
  EXPECT_EQ(h.token_share_above.back().first, 4096);
  for (const auto& [edge, share] : h.token_share_above) {
    const double expected = edge < 100 ? 1.0 : 5000.0 / 5900.0;
    EXPECT_DOUBLE_EQ(share, expected) << "edge " << edge;
  }
  // Printed from 64 (the last power of two with every token above it) up.
  const std::string line = h.describe();
  EXPECT_NE(line.find("min 100, p50 100, p90 100, max 5000"), std::string::npos) << line;
  EXPECT_NE(line.find("> 64: 100.0%"), std::string::npos) << line;
  EXPECT_NE(line.find("> 4096: 84.7%"), std::string::npos) << line;
  EXPECT_EQ(line.find("> 32:"), std::string::npos) << line;
}

TEST(LengthHistogram, P90OfTwentyAndEdgeCases) {
  std::vector<int64_t> lengths;
  for (int64_t i = 1; i <= 20; ++i) lengths.push_back(i);
  const LengthHistogram h = length_histogram(lengths);
  EXPECT_EQ(h.p50, 10);
  EXPECT_EQ(h.p90, 18);
  EXPECT_EQ(length_histogram({}).count, 0);
  EXPECT_TRUE(length_histogram({1, 1}).token_share_above.empty());
  EXPECT_NE(error_of([] { length_histogram({3, 0}); }).find("length 0 at index 1"), std::string::npos);
}
