// `dcp bench-attention` as a user runs it: the files it writes, the skip accounting, and usage errors (exit 2).
#include <gtest/gtest.h>

#include <fcntl.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "distributed/process.h"

namespace fs = std::filesystem;
using dcp::test::Child;
using dcp::test::exited_ok;

namespace {

fs::path make_workdir(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / ("dcp_bench_attention_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string read(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// CSV rows keyed by "variant,length".
std::map<std::string, std::vector<std::string>> csv_rows(const fs::path& p) {
  std::map<std::string, std::vector<std::string>> rows;
  std::ifstream in(p);
  std::string header;
  std::getline(in, header);
  EXPECT_EQ(header, "variant,length,status,seconds,runs,peak_bytes,predicted_bytes,time_ratio_to_softmax,skip_reason");
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> fields;
    std::stringstream ss(line);
    for (std::string f; std::getline(ss, f, ',');) fields.push_back(f);
    rows[fields.at(0) + "," + fields.at(1)] = fields;
  }
  return rows;
}

std::vector<std::string> tiny_args(const fs::path& out, const std::string& lengths = "64,128") {
  return {DCP_BINARY, "bench-attention", "--lengths", lengths, "--heads", "2", "--head-dim", "8",
          "--num-features", "8", "--chunk-size", "16", "--repetitions", "1", "--threads", "1", "--out", out.string()};
}

}  // namespace

TEST(CliBenchAttention, WritesEveryVariantAndLengthWithPlot) {
  fs::path dir = make_workdir("all");
  Child c = Child::spawn(tiny_args(dir / "res" / "attn"), {}, (dir / "run.log").string());
  ASSERT_TRUE(exited_ok(c.wait(120))) << c.log();
  EXPECT_TRUE(fs::exists(dir / "res" / "attn.png"));
  EXPECT_FALSE(fs::exists(dir / "res" / "attn.gnuplot")) << "the script is removed after a successful plot";
  const auto rows = csv_rows(dir / "res" / "attn.csv");
  EXPECT_EQ(rows.size(), 12u);
  for (const char* v : {"softmax", "softmax-reference", "stationary", "nonstationary", "fixed", "elu"}) {
    for (const char* len : {"64", "128"}) {
      const auto& r = rows.at(std::string(v) + "," + len);
      EXPECT_EQ(r.at(2), "measured") << v << len;
      EXPECT_GT(std::stod(r.at(3)), 0) << v << len;
      EXPECT_EQ(r.at(4), "1") << v << len;
      EXPECT_GT(std::stod(r.at(5)), 0) << v << len;
      EXPECT_GT(std::stod(r.at(6)), 0) << v << len;  // predicted bytes, every variant
    }
  }
  const std::string md = read(dir / "res" / "attn.md");
  EXPECT_NE(md.find("bench-attention --lengths 64,128 --heads 2"), std::string::npos) << md;
  EXPECT_NE(md.find("| nonstationary |"), std::string::npos) << md;
  EXPECT_NE(md.find("Skips (never silent; 0 of 12 points)"), std::string::npos) << md;
  EXPECT_NE(md.find("![time and peak memory against length](attn.png)"), std::string::npos) << md;
  fs::remove_all(dir);
}

TEST(CliBenchAttention, CountsSkippedSoftmaxPointsUnderATinyMemoryLimit) {
  fs::path dir = make_workdir("skip");
  auto args = tiny_args(dir / "attn");
  // Between the reference softmax's predicted peak at 64 tokens (139 KB) and elu's at 128 (197 KB): the
  // reference fits at 64 only, elu's linear prediction is guarded too and fits at 64 only.
  args.insert(args.end(), {"--no-plot", "--variants", "softmax-reference,elu", "--max-bytes", "150000"});
  Child c = Child::spawn(args, {}, (dir / "run.log").string());
  ASSERT_TRUE(exited_ok(c.wait(120))) << c.log();
  EXPECT_FALSE(fs::exists(dir / "attn.png"));
  const auto rows = csv_rows(dir / "attn.csv");
  EXPECT_EQ(rows.size(), 4u);
  for (const char* v : {"softmax-reference,", "elu,"}) {
    EXPECT_EQ(rows.at(std::string(v) + "64").at(2), "measured");
    EXPECT_EQ(rows.at(std::string(v) + "128").at(2), "skipped");
    EXPECT_NE(rows.at(std::string(v) + "128").at(8).find("--max-bytes"), std::string::npos);
  }
  const std::string md = read(dir / "attn.md");
  EXPECT_NE(md.find("Skips (never silent; 2 of 4 points)"), std::string::npos) << md;
  EXPECT_NE(md.find("> --max-bytes 150000 B"), std::string::npos) << md;
  EXPECT_NE(md.find("| softmax-reference | 1 | 1 |"), std::string::npos) << md;
  EXPECT_NE(md.find("| elu | 1 | 1 |"), std::string::npos) << md;
  fs::remove_all(dir);
}

TEST(CliBenchAttention, BadOptionsExitWithUsageErrorsNamingThem) {
  fs::path dir = make_workdir("bad");
  struct Case {
    std::vector<std::string> args;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{"--lengths", "64,0"}, "--lengths: bad length '0' in '64,0'"},
      {{"--variants", "softmax,cosine"}, "--variants: unknown variant 'cosine'"},
      {{"--heads", "0"}, "--heads"},
      {{"--max-seconds", "-1"}, "--max-seconds"},
      {{"--max-seconds", "nan"}, "--max-seconds: must be a positive finite number of seconds, got 'nan'"},
      {{"--max-bytes", "nan"}, "--max-bytes: must be a positive finite number of bytes (at least 1), got 'nan'"},
      {{"--max-bytes", "0.5"}, "got '0.5'"},
      {{"--out", ""}, "--out: must be a path prefix ending in a file name stem"},
      {{"--out", (dir / "sub/").string()}, "--out: must be a path prefix ending in a file name stem"},
      {{"--out", "/proc/x/y"}, "--out '/proc/x/y': cannot create the folder '/proc/x'"},
      {{"--attention.normalizer=bogus"}, "attention.normalizer"},
  };
  for (const auto& c : cases) {
    const bool lengths = c.args[0] == "--lengths";
    auto args = tiny_args(dir / "attn", lengths ? c.args[1] : "64,128");
    if (c.args[0] == "--out") {
      args.back() = c.args[1];  // tiny_args ends with --out PREFIX
    } else if (!lengths) {
      args.insert(args.end(), c.args.begin(), c.args.end());
    }
    Child ch = Child::spawn(args, {}, (dir / "bad.log").string());
    const int status = ch.wait(60);
    EXPECT_TRUE(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 2) << c.expected << "\n" << ch.log();
    EXPECT_NE(ch.log().find(c.expected), std::string::npos) << ch.log();
  }
  EXPECT_FALSE(fs::exists(dir / "attn.md")) << "nothing is written on bad input";
  fs::remove_all(dir);
}
