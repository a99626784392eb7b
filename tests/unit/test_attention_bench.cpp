// `dcp bench-attention`: the measured peak memory grows as each operator's algorithm says (quadratic for softmax,
// linear for the chunked flexformer forms), points are skipped with their reason, and the report's slope and
// crossover are computed as documented.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>

#include "cli/attention_bench_report.h"
#include "dcp/config.h"
#include "dcp/attention_bench.h"
#include "dcp/memory_meter.h"

using dcp::AttentionBenchOptions;
using dcp::AttentionBenchPoint;

namespace {

AttentionBenchOptions tiny(std::vector<int64_t> lengths) {
  AttentionBenchOptions o;
  o.lengths = std::move(lengths);
  o.variants = dcp::attention_bench_variants();
  o.heads = 2;
  o.head_dim = 8;
  o.num_features = 8;
  o.chunk_size = 16;
  o.repetitions = 1;
  o.max_bytes = 1e12;
  o.max_seconds = 1e6;
  return o;
}

std::map<std::string, std::map<int64_t, AttentionBenchPoint>> by_variant(const std::vector<AttentionBenchPoint>& ps) {
  std::map<std::string, std::map<int64_t, AttentionBenchPoint>> out;
  for (const auto& p : ps) out[p.variant][p.length] = p;
  return out;
}

AttentionBenchPoint measured(const std::string& variant, int64_t length, double seconds) {
  AttentionBenchPoint p;
  p.variant = variant;
  p.length = length;
  p.measured = true;
  p.seconds = seconds;
  p.runs = 1;
  p.peak_bytes = 1e6 * static_cast<double>(length);
  return p;
}

AttentionBenchPoint skipped(const std::string& variant, int64_t length, const std::string& reason) {
  AttentionBenchPoint p;
  p.variant = variant;
  p.length = length;
  p.skip_reason = reason;
  return p;
}

}  // namespace

TEST(AttentionBench, PeakMemoryIsQuadraticForSoftmaxAndLinearForChunkedFlexformer) {
  torch::set_num_threads(1);
  ASSERT_EQ(dcp::MemoryMeter::install(), "counting-allocator");
  auto points = by_variant(dcp::bench_attention(tiny({512, 1024})));
  ASSERT_EQ(points.size(), dcp::attention_bench_variants().size());
  for (const auto& [variant, ps] : points) {
    ASSERT_EQ(ps.size(), 2u) << variant;
    for (const auto& [len, p] : ps) {
      ASSERT_TRUE(p.measured) << variant << " " << len << ": " << p.skip_reason;
      EXPECT_EQ(p.runs, 1);
      EXPECT_GT(p.seconds, 0);
      EXPECT_GT(p.peak_bytes, 0);
    }
    const double growth = ps.at(1024).peak_bytes / ps.at(512).peak_bytes;
    if (variant == "softmax-reference") {
      EXPECT_GT(growth, 3.6) << variant;
      EXPECT_LT(growth, 4.1) << variant;
    } else {
      // Linear; the tiled operator's fixed per-thread tile workspace flattens the growth at these small sizes.
      EXPECT_GT(growth, variant == "softmax" ? 1.6 : 1.8) << variant;
      EXPECT_LT(growth, 2.2) << variant;
    }
  }
  // The prediction that decides softmax skips is an upper bound, and a close one.
  for (int64_t len : {512, 1024}) {
    const AttentionBenchPoint& p = points["softmax-reference"].at(len);
    EXPECT_DOUBLE_EQ(p.predicted_bytes, dcp::softmax_attention_peak_bytes(len, 2, 8));
    EXPECT_LE(p.peak_bytes, p.predicted_bytes) << len;
    EXPECT_GT(p.peak_bytes, 0.85 * p.predicted_bytes) << len;
  }
  // The tiled softmax and flexformer predictions, linear in length, are within a factor of the measured peak.
  for (const auto& [variant, ps] : points) {
    if (variant == "softmax-reference") continue;
    for (const auto& [len, p] : ps) {
      EXPECT_GT(p.predicted_bytes, 0) << variant;
      EXPECT_LT(p.peak_bytes, 1.5 * p.predicted_bytes) << variant << " " << len;
      EXPECT_GT(p.peak_bytes, p.predicted_bytes / 1.5) << variant << " " << len;
    }
  }
}

TEST(AttentionBench, AFailedAllocationSkipsThePointAndTheLongerLengths) {
  auto o = tiny({64, 1000000000, 2000000000});  // q alone at 1e9 tokens: 64 GB
  o.variants = {"elu"};
  o.max_bytes = 1e15;
  auto points = by_variant(dcp::bench_attention(o));
  EXPECT_TRUE(points["elu"].at(64).measured);
  const auto& failed = points["elu"].at(1000000000);
  EXPECT_FALSE(failed.measured);
  EXPECT_EQ(failed.skip_reason.rfind("allocation failed: ", 0), 0u) << failed.skip_reason;
  EXPECT_EQ(failed.skip_reason.find('\n'), std::string::npos) << failed.skip_reason;
  EXPECT_EQ(points["elu"].at(2000000000).skip_reason, "an allocation at 1000000000 tokens failed");
}

TEST(AttentionBench, SkipsSoftmaxOverTheMemoryLimitAndLongerLengthsAfterTheTimeCap) {
  auto o = tiny({64, 128});
  o.max_bytes = dcp::softmax_attention_peak_bytes(64, 2, 8);  // 64 fits exactly, 128 does not
  auto points = by_variant(dcp::bench_attention(o));
  EXPECT_TRUE(points["softmax-reference"].at(64).measured);
  EXPECT_FALSE(points["softmax-reference"].at(128).measured);
  EXPECT_NE(points["softmax-reference"].at(128).skip_reason.find("needs"), std::string::npos);
  EXPECT_NE(points["softmax-reference"].at(128).skip_reason.find("--max-bytes"), std::string::npos);
  // The flexformer variants are guarded by their own (linear) prediction: elu needs 98 KB at 64, 197 KB at 128.
  EXPECT_TRUE(points["elu"].at(64).measured);
  EXPECT_NE(points["elu"].at(128).skip_reason.find("--max-bytes"), std::string::npos);

  o = tiny({64, 128, 256});
  o.variants = {"stationary"};
  o.repetitions = 3;
  o.max_seconds = 1e-9;  // every run exceeds it, the warm-up first
  points = by_variant(dcp::bench_attention(o));
  const auto& first = points["stationary"].at(64);
  EXPECT_TRUE(first.measured);
  EXPECT_EQ(first.runs, 0);  // the warm-up's time is the point's; no timed run follows
  EXPECT_GT(first.seconds, 0);
  EXPECT_GT(first.peak_bytes, 0);
  for (int64_t len : {128, 256}) {
    const auto& p = points["stationary"].at(len);
    EXPECT_FALSE(p.measured);
    EXPECT_NE(p.skip_reason.find("a run at 64 tokens took"), std::string::npos) << p.skip_reason;
    EXPECT_NE(p.skip_reason.find("--max-seconds"), std::string::npos) << p.skip_reason;
  }
}

TEST(AttentionBench, RejectsBadOptionsByName) {
  auto o = tiny({64});
  o.variants = {"cosine"};
  EXPECT_THROW(dcp::bench_attention(o), std::invalid_argument);
  o = tiny({0});
  EXPECT_THROW(dcp::bench_attention(o), std::invalid_argument);
  o = tiny({64});
  o.normalizer = "bogus";
  EXPECT_THROW(dcp::bench_attention(o), dcp::ConfigError);
}

TEST(AttentionBenchReport, LogLogSlopeIsTheExponent) {
  EXPECT_NEAR(dcp::loglog_slope({1024, 2048, 4096}, {3.0, 3.0 * std::pow(2.0, 1.5), 3.0 * std::pow(4.0, 1.5)}), 1.5,
              1e-12);
  EXPECT_THROW(dcp::loglog_slope({1024}, {1.0}), std::invalid_argument);
  EXPECT_THROW(dcp::loglog_slope({1024, 2048}, {1.0, 0.0}), std::invalid_argument);
  EXPECT_THROW(dcp::loglog_slope({1024, 1024}, {1.0, 2.0}), std::invalid_argument);
}

TEST(AttentionBenchReport, SlopeCrossoverAndSkipsPerVariant) {
  // softmax quadratic, measured up to 8K; "stationary" linear: ratios 2.2, 1.1, 0.55 at 2K, 4K, 8K;
  // "elu" slower at 2K, faster at 4K, slower again at 8K; "fixed" faster everywhere compared.
  std::vector<AttentionBenchPoint> pts;
  for (int64_t len : {2048, 4096, 8192}) pts.push_back(measured("softmax", len, 1e-8 * len * len / 2048));
  pts.push_back(skipped("softmax", 16384, "needs 99.0 GB > --max-bytes 1.0 GB"));
  for (int64_t len : {2048, 4096, 8192, 16384}) pts.push_back(measured("stationary", len, 2.2e-8 * len));
  pts.push_back(measured("elu", 2048, 3e-5));
  pts.push_back(measured("elu", 4096, 5e-5));
  pts.push_back(measured("elu", 8192, 5e-4));
  pts.push_back(measured("fixed", 2048, 1e-5));
  pts.push_back(measured("fixed", 4096, 2e-5));
  pts.push_back(skipped("fixed", 8192, "a run at 4096 tokens took 9.0 s > --max-seconds 1"));

  const auto s = dcp::summarize_attention_bench(pts);
  ASSERT_EQ(s.size(), 4u);
  EXPECT_EQ(s[0].variant, "softmax");
  EXPECT_EQ(s[0].measured, 3);
  EXPECT_EQ(s[0].skipped, 1);
  EXPECT_NEAR(*s[0].slope, 2.0, 1e-9);
  EXPECT_EQ(s[0].slope_points, 2);  // the lengths >= 4K
  EXPECT_EQ(s[0].slope_from, 4096);
  EXPECT_FALSE(s[0].crossover);

  EXPECT_NEAR(*s[1].slope, 1.0, 1e-9);
  EXPECT_EQ(s[1].slope_points, 3);
  ASSERT_TRUE(s[1].crossover);
  EXPECT_EQ(s[1].crossover->compared, 3);
  EXPECT_EQ(*s[1].crossover->from_length, 8192);
  EXPECT_NEAR(*s[1].crossover->interpolated, 4096 * 1.1, 1e-6);  // log ratio log(1.1) -> log(0.55) over one octave
  EXPECT_EQ(s[1].longest, 16384);

  EXPECT_FALSE(s[2].crossover->from_length);  // elu is slower at the longest compared length
  EXPECT_EQ(s[2].crossover->longest_compared, 8192);

  EXPECT_EQ(*s[3].crossover->from_length, 2048);  // faster at every compared length
  EXPECT_FALSE(s[3].crossover->interpolated);
  EXPECT_EQ(s[3].skipped, 1);
  EXPECT_EQ(s[3].slope_points, 2);  // fewer than 2 lengths >= 4K: all measured ones

  // Interpolation is geometric: ratios 4 at 1K and 1/4 at 4K cross at 2K.
  std::vector<AttentionBenchPoint> two = {measured("softmax", 1024, 1.0), measured("softmax", 4096, 4.0),
                                          measured("elu", 1024, 4.0), measured("elu", 4096, 1.0)};
  EXPECT_NEAR(*dcp::summarize_attention_bench(two)[1].crossover->interpolated, 2048, 1e-6);

  const std::string md = dcp::attention_bench_markdown_tables(pts, s);
  EXPECT_NE(md.find("skipped: needs 99.0 GB > --max-bytes 1.0 GB"), std::string::npos) << md;
  EXPECT_NE(md.find("8K (interpolated 4506)"), std::string::npos) << md;
  EXPECT_NE(md.find("none up to 8K"), std::string::npos) << md;
  EXPECT_NE(md.find("(0.55x)"), std::string::npos) << md;  // stationary at 8K
  const std::string csv = dcp::attention_bench_csv(pts);
  EXPECT_NE(csv.find("stationary,8192,measured,0.000180,1,8192000000,,0.5500,\"\""), std::string::npos) << csv;
  EXPECT_NE(csv.find("fixed,8192,skipped,,,,,,\"a run at 4096"), std::string::npos) << csv;
}
