// `dcp bench-attention` as a user runs it: the files it writes (fp32 and bf16, head_dim 8 and 64), the skip
// accounting, and usage errors (exit 2).
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
  EXPECT_EQ(header,
            "variant,dtype,length,status,runs,forward_seconds,backward_seconds,seconds,time_ratio_to_softmax,"
            "speedup_over_reference,forward_flops,backward_flops,flops_source,gflops,fraction_of_peak,peak_bytes,"
            "input_bytes,io_bytes,memory_ratio,predicted_bytes,skip_reason");
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> fields;
    std::stringstream ss(line);
    for (std::string f; std::getline(ss, f, ',');) fields.push_back(f);
    rows[fields.at(0) + "," + fields.at(2)] = fields;
  }
  return rows;
}

// CSV columns, as attention_bench_csv writes them.
enum Column {
  kDtype = 1, kStatus = 3, kRuns = 4, kForward = 5, kBackward = 6, kSeconds = 7, kSpeedup = 9, kForwardFlops = 10,
  kGflops = 13, kFraction = 14, kPeak = 15, kInput = 16, kIo = 17, kMemoryRatio = 18, kPredicted = 19,
  kSkipReason = 20
};

// A 256^3 matmul peak keeps the run short; the default 2048^3 is the report's yardstick.
std::vector<std::string> tiny_args(const fs::path& out, const std::string& lengths = "64,128") {
  return {DCP_BINARY, "bench-attention", "--lengths", lengths, "--heads", "2", "--head-dim", "8",
          "--num-features", "8", "--chunk-size", "16", "--repetitions", "1", "--threads", "1",
          "--matmul-size", "256", "--out", out.string()};
}

}  // namespace

// On a CPU with AVX-512 dcp re-executes itself so that OpenBLAS loads its AVX-512 kernels rather than the
// Prescott fallback it picks for CPU models it does not know (src/cli/blas_cores.h); the report names the kernels.
TEST(CliBenchAttention, UsesAvx512BlasKernelsWhereTheCpuHasThem) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string text((std::istreambuf_iterator<char>(cpuinfo)), std::istreambuf_iterator<char>());
  if (text.find(" avx512f ") == std::string::npos || text.find(" avx512vl") == std::string::npos) {
    GTEST_SKIP() << "no AVX-512 here";
  }
  fs::path dir = make_workdir("blas");
  auto args = tiny_args(dir / "attn", "64");
  args.insert(args.end(), {"--no-plot", "--variants", "softmax"});
  // A machine's own OPENBLAS_CORETYPE (this workplace sets Haswell on AMD EPYC) is the user's choice, which dcp
  // keeps (checked below), so the child runs without one.
  Child c = Child::spawn(args, {}, (dir / "run.log").string(), {"OPENBLAS_CORETYPE"});
  ASSERT_TRUE(exited_ok(c.wait(60))) << c.log();
  const std::string md = read(dir / "attn.md");
  EXPECT_EQ(md.find(" Prescott "), std::string::npos) << md;
  EXPECT_TRUE(md.find(" Cooperlake ") != std::string::npos || md.find(" SkylakeX ") != std::string::npos ||
              md.find(" SapphireRapids ") != std::string::npos)
      << md;

  Child chosen = Child::spawn(args, {{"OPENBLAS_CORETYPE", "Haswell"}}, (dir / "chosen.log").string());
  ASSERT_TRUE(exited_ok(chosen.wait(60))) << chosen.log();
  EXPECT_NE(read(dir / "attn.md").find(" Haswell "), std::string::npos) << "the user's OPENBLAS_CORETYPE is kept";
  fs::remove_all(dir);
}

TEST(CliBenchAttention, WritesEveryVariantAndLengthWithPlot) {
  fs::path dir = make_workdir("all");
  Child c = Child::spawn(tiny_args(dir / "res" / "attn"), {}, (dir / "run.log").string());
  ASSERT_TRUE(exited_ok(c.wait(120))) << c.log();
  EXPECT_TRUE(fs::exists(dir / "res" / "attn.png"));
  EXPECT_FALSE(fs::exists(dir / "res" / "attn.gnuplot")) << "the script is removed after a successful plot";
  const auto rows = csv_rows(dir / "res" / "attn.csv");
  EXPECT_EQ(rows.size(), 20u);
  for (const char* v : {"softmax", "softmax-reference", "stationary", "nonstationary", "fixed", "elu",
                        "stationary-reference", "nonstationary-reference", "fixed-reference", "elu-reference"}) {
    for (const char* len : {"64", "128"}) {
      const auto& r = rows.at(std::string(v) + "," + len);
      EXPECT_EQ(r.at(kDtype), "fp32") << v << len;
      EXPECT_EQ(r.at(kStatus), "measured") << v << len;
      EXPECT_EQ(r.at(kRuns), "1") << v << len;
      EXPECT_GT(std::stod(r.at(kForward)), 0) << v << len;
      EXPECT_GT(std::stod(r.at(kBackward)), 0) << v << len;
      EXPECT_GT(std::stod(r.at(kSeconds)), 0) << v << len;
      EXPECT_GT(std::stod(r.at(kForwardFlops)), 0) << v << len;
      EXPECT_GT(std::stod(r.at(kGflops)), 0) << v << len;
      EXPECT_GT(std::stod(r.at(kFraction)), 0) << v << len;
      EXPECT_GT(std::stod(r.at(kPeak)), 0) << v << len;
      EXPECT_GT(std::stod(r.at(kInput)), 0) << v << len;
      EXPECT_GT(std::stod(r.at(kIo)), 0) << v << len;
      EXPECT_GT(std::stod(r.at(kMemoryRatio)), 0) << v << len;
      EXPECT_GT(std::stod(r.at(kPredicted)), 0) << v << len;  // every variant
    }
  }
  EXPECT_GT(std::stod(rows.at("softmax,64").at(kSpeedup)), 0);  // softmax-reference time / softmax time
  const std::string md = read(dir / "res" / "attn.md");
  EXPECT_NE(md.find("# dcp bench-attention: fp32, 2 heads x head_dim 8, 10 variants, 64 to 128 tokens"),
            std::string::npos)
      << md;
  EXPECT_NE(md.find("bench-attention --lengths 64,128 --heads 2"), std::string::npos) << md;
  EXPECT_NE(md.find("Matmul peak (measured by this run before the points, intra-op threads: 1): torch::matmul of "
                    "two random [256, 256] matrices"),
            std::string::npos)
      << md;
  EXPECT_NE(md.find("| softmax-reference | speedup |"), std::string::npos) << md;
  EXPECT_NE(md.find("; BLAS: "), std::string::npos) << md;
  EXPECT_NE(md.find("| nonstationary |"), std::string::npos) << md;
  // The fused kernel beside its autograd twin, per feature map.
  EXPECT_NE(md.find("| stationary | stationary-reference | speedup |"), std::string::npos) << md;
  EXPECT_GT(std::stod(rows.at("stationary,64").at(kSpeedup)), 0);  // stationary-reference time / stationary time
  EXPECT_NE(md.find("Skips (never silent; 0 of 20 points)"), std::string::npos) << md;
  EXPECT_NE(md.find("![time, peak memory and % of peak against length](attn.png)"), std::string::npos) << md;
  fs::remove_all(dir);
}

TEST(CliBenchAttention, Bf16AtHeadDim64MeasuresBothSoftmaxVariants) {
  fs::path dir = make_workdir("bf16");
  auto args = tiny_args(dir / "attn");
  args.at(7) = "64";  // --head-dim
  args.insert(args.end(), {"--no-plot", "--dtype", "bf16", "--variants", "softmax,softmax-reference,elu"});
  Child c = Child::spawn(args, {}, (dir / "run.log").string());
  ASSERT_TRUE(exited_ok(c.wait(120))) << c.log();
  const auto rows = csv_rows(dir / "attn.csv");
  EXPECT_EQ(rows.size(), 6u);
  for (const auto& [key, r] : rows) {
    EXPECT_EQ(r.at(kDtype), "bf16") << key;
    EXPECT_EQ(r.at(kStatus), "measured") << key;
    // IO at bf16: 8 tensors [L, 2, 64] of 2 bytes and the fp32 logsumexp.
    const double len = std::stod(key.substr(key.find(',') + 1));
    EXPECT_DOUBLE_EQ(std::stod(r.at(kIo)), len * 2 * (8 * 64 * 2 + 4)) << key;
  }
  const std::string md = read(dir / "attn.md");
  EXPECT_NE(md.find("# dcp bench-attention: bf16, 2 heads x head_dim 64, 3 variants"), std::string::npos) << md;
  EXPECT_NE(md.find("--dtype bf16"), std::string::npos) << md;
  fs::remove_all(dir);
}

TEST(CliBenchAttention, CountsSkippedSoftmaxPointsUnderATinyMemoryLimit) {
  fs::path dir = make_workdir("skip");
  auto args = tiny_args(dir / "attn");
  // Between the reference softmax's predicted peak at 64 tokens (123 KB) and elu-reference's at 128 (197 KB):
  // the reference fits at 64 only, the autograd twin's linear prediction is guarded too and fits at 64 only.
  args.insert(args.end(), {"--no-plot", "--variants", "softmax-reference,elu-reference", "--max-bytes", "150000"});
  Child c = Child::spawn(args, {}, (dir / "run.log").string());
  ASSERT_TRUE(exited_ok(c.wait(120))) << c.log();
  EXPECT_FALSE(fs::exists(dir / "attn.png"));
  const auto rows = csv_rows(dir / "attn.csv");
  EXPECT_EQ(rows.size(), 4u);
  for (const char* v : {"softmax-reference,", "elu-reference,"}) {
    EXPECT_EQ(rows.at(std::string(v) + "64").at(kStatus), "measured");
    EXPECT_EQ(rows.at(std::string(v) + "128").at(kStatus), "skipped");
    EXPECT_NE(rows.at(std::string(v) + "128").at(kSkipReason).find("--max-bytes"), std::string::npos);
  }
  const std::string md = read(dir / "attn.md");
  EXPECT_NE(md.find("Skips (never silent; 2 of 4 points)"), std::string::npos) << md;
  EXPECT_NE(md.find("> --max-bytes 150000 B"), std::string::npos) << md;
  EXPECT_NE(md.find("| softmax-reference | 1 | 1 |"), std::string::npos) << md;
  EXPECT_NE(md.find("| elu-reference | 1 | 1 |"), std::string::npos) << md;
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
      {{"--max-bytes", "0x10"}, "--max-bytes: must be a positive finite number of bytes (at least 1), got '0x10'"},
      {{"--out", ""}, "--out: must be a path prefix ending in a file name stem"},
      {{"--out", (dir / "sub/").string()}, "--out: must be a path prefix ending in a file name stem"},
      {{"--out", "/proc/x/y"}, "--out '/proc/x/y': cannot create the folder '/proc/x'"},
      {{"--attention.normalizer=bogus"}, "attention.normalizer"},
      {{"--attention.feature_map=elu"}, "bench-attention does not use attention.feature_map"},
      {{"--train.threads=4"}, "bench-attention does not use train.threads"},
      {{"--attention.chunk_size=32"}, "the flag that replaces attention.chunk_size (--chunk-size) were both given"},
      {{"--dtype", "fp16"}, "--dtype: unknown dtype 'fp16' (allowed: fp32, bf16)"},
      {{"--matmul-size", "0"}, "--matmul-size"},
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
