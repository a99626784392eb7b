// `dcp bench-attention`: the measured peak memory grows as each operator's algorithm says (quadratic for the
// reference softmax, linear for the tiled one and the chunked flexformer forms) and matches the predictions that
// decide skips, in fp32 and bf16; points are skipped with their reason; the FLOP counts, rates, fractions of peak,
// memory ratios, slopes and crossover of the report are computed as documented.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <map>

#include "tools/attention_bench_report.h"
#include "dcp/config.h"
#include "tools/attention_bench.h"
#include "dcp/attention_kernels.h"
#include "dcp/cost_model.h"
#include "dcp/cpu_features.h"
#include "tools/matmul_peak.h"
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
  p.dtype = "fp32";
  p.seconds = seconds;
  p.forward_seconds = 0.4 * seconds;
  p.backward_seconds = 0.6 * seconds;
  p.runs = 1;
  p.peak_bytes = 1e6 * static_cast<double>(length);
  return p;
}

AttentionBenchPoint skipped(const std::string& variant, int64_t length, const std::string& reason) {
  AttentionBenchPoint p;
  p.variant = variant;
  p.dtype = "fp32";
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
      // (At 2 heads x 8 the tiled operator's fixed tiles, 64 x 128, are a third of its peak at 512 tokens.)
      EXPECT_GT(growth, variant == "softmax" ? 1.3 : 1.8) << variant;
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

TEST(AttentionBench, Bf16MeasuresBothSoftmaxVariantsWithPredictionsScaledToTheElementSize) {
  torch::set_num_threads(1);
  ASSERT_EQ(dcp::MemoryMeter::install(), "counting-allocator");
  auto o = tiny({512, 1024});
  o.head_dim = 32;  // a whole AMX row, so that the prediction's padding is exact
  o.variants = {"softmax", "softmax-reference", "elu"};
  auto fp32 = by_variant(dcp::bench_attention(o));
  o.dtype = "bf16";
  auto bf16 = by_variant(dcp::bench_attention(o));
  const bool amx = dcp::amx_usable();
  for (int64_t len : {512, 1024}) {
    for (const auto& v : o.variants) {
      const AttentionBenchPoint& p = bf16[v].at(len);
      ASSERT_TRUE(p.measured) << v << " " << len << ": " << p.skip_reason;
      EXPECT_EQ(p.dtype, "bf16");
      EXPECT_GT(p.seconds, 0);
      EXPECT_GT(p.forward_seconds, 0);
      EXPECT_GT(p.backward_seconds, 0);
      EXPECT_DOUBLE_EQ(p.input_bytes, 4.0 * len * 2 * 32 * 2 + (v == "elu" ? 8 : 0)) << v;  // q, k, v, g (+ alpha)
      EXPECT_DOUBLE_EQ(p.io_bytes, dcp::attention_io_bytes(len, 2, 32, 2));
      EXPECT_EQ(fp32[v].at(len).dtype, "fp32");
    }
    const AttentionBenchPoint& tiled = bf16["softmax"].at(len);
    EXPECT_DOUBLE_EQ(tiled.predicted_bytes, dcp::tiled_attention_peak_bytes(len, 2, 32, 1, 2, amx));
    EXPECT_LT(tiled.peak_bytes, 1.2 * tiled.predicted_bytes) << len;
    EXPECT_GT(tiled.peak_bytes, tiled.predicted_bytes / 1.2) << len;
    if (amx) EXPECT_LT(tiled.peak_bytes, 0.8 * fp32["softmax"].at(len).peak_bytes) << len;  // half-size tensors
    const AttentionBenchPoint& ref = bf16["softmax-reference"].at(len);
    EXPECT_DOUBLE_EQ(ref.predicted_bytes, dcp::softmax_attention_peak_bytes(len, 2, 32, 2));
    EXPECT_LE(ref.peak_bytes, ref.predicted_bytes) << len;
    EXPECT_GT(ref.peak_bytes, 0.85 * ref.predicted_bytes) << len;
    const AttentionBenchPoint& elu = bf16["elu"].at(len);
    EXPECT_LT(elu.peak_bytes, 1.5 * elu.predicted_bytes) << len;
    EXPECT_GT(elu.peak_bytes, elu.predicted_bytes / 1.5) << len;
  }
  EXPECT_NEAR(bf16["softmax-reference"].at(1024).peak_bytes / bf16["softmax-reference"].at(512).peak_bytes, 4, 0.4);
}

// The tiled operator's bf16 path without AMX tiles (portable loops: the fp32 copies a CPU without AMX runs on)
// against its prediction, which decides skips there.
TEST(AttentionBench, TiledPredictionCoversTheBf16UpcastPath) {
  torch::set_num_threads(1);
  ASSERT_EQ(dcp::MemoryMeter::install(), "counting-allocator");
  const int64_t len = 1024, heads = 2, head_dim = 32;
  const auto shape = std::vector<int64_t>{len, heads, head_dim};
  auto q = torch::randn(shape).to(torch::kBFloat16).requires_grad_();
  auto k = torch::randn(shape).to(torch::kBFloat16).requires_grad_();
  auto v = torch::randn(shape).to(torch::kBFloat16).requires_grad_();
  const auto g = torch::randn(shape).to(torch::kBFloat16);
  const auto cu = torch::tensor(std::vector<int64_t>{0, len}, torch::kInt64);
  dcp::AttentionOptions portable;
  portable.portable = true;
  const int64_t resident = dcp::MemoryMeter::current_bytes();
  dcp::MemoryMeter::reset_peak();
  const auto out = dcp::tiled_attention(q, k, v, cu, cu, /*causal=*/true, portable);
  torch::autograd::backward({out}, {g});
  const double peak = static_cast<double>(dcp::MemoryMeter::peak_bytes() - resident);
  const double predicted = dcp::tiled_attention_peak_bytes(len, heads, head_dim, 1, 2, /*amx_tiles=*/false);
  EXPECT_LT(peak, 1.1 * predicted);
  EXPECT_GT(peak, predicted / 1.1);
  EXPECT_GT(predicted, dcp::tiled_attention_peak_bytes(len, heads, head_dim, 1, 4));  // the fp32 copies cost more
}

TEST(AttentionBench, TiledSoftmaxHoldsUnder1p2TimesItsIoAtFourHeadsOf32) {
  torch::set_num_threads(1);
  ASSERT_EQ(dcp::MemoryMeter::install(), "counting-allocator");
  auto o = tiny({2048});
  o.heads = 4;
  o.head_dim = 32;
  o.variants = {"softmax"};
  for (const char* dtype : {"fp32", "bf16"}) {
    o.dtype = dtype;
    const auto p = dcp::bench_attention(o).at(0);
    ASSERT_TRUE(p.measured) << p.skip_reason;
    const double ratio = (p.input_bytes + p.peak_bytes) / p.io_bytes;
    // An exact operator holds at least its IO; issue 10's target for the tiled one is 1.2x. bf16 keeps it only on
    // AMX tiles: elsewhere it computes on fp32 copies (TiledPredictionCoversTheBf16UpcastPath), measured 2.9x.
    EXPECT_GE(ratio, 1.0) << dtype;
    if (std::string(dtype) == "fp32" || dcp::amx_usable()) EXPECT_LT(ratio, 1.2) << dtype;
    EXPECT_LT(p.peak_bytes, 1.1 * p.predicted_bytes) << dtype;
    EXPECT_GT(p.peak_bytes, p.predicted_bytes / 1.1) << dtype;
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
  // The flexformer variants are guarded by their own (linear) predictions: the autograd twin elu-reference needs
  // 98 KB at 64, 197 KB at 128; the fused kernel's elu holds no per-chunk state (fused_flexformer_peak_bytes:
  // 35 KB at 64, 52 KB at 128), so both fit.
  EXPECT_TRUE(points["elu-reference"].at(64).measured);
  EXPECT_NE(points["elu-reference"].at(128).skip_reason.find("--max-bytes"), std::string::npos);
  EXPECT_LT(points["elu"].at(128).predicted_bytes, 0.6 * points["elu-reference"].at(128).predicted_bytes);
  EXPECT_TRUE(points["elu"].at(128).measured) << points["elu"].at(128).skip_reason;

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
  o = tiny({64});
  o.dtype = "fp16";
  EXPECT_THROW(dcp::bench_attention(o), std::invalid_argument);
  EXPECT_THROW(dcp::attention_bench_element_bytes("fp16"), std::invalid_argument);
  EXPECT_THROW(dcp::tiled_attention_peak_bytes(64, 2, 8, 1, 3), std::invalid_argument);
  EXPECT_THROW(dcp::softmax_attention_peak_bytes(64, 2, 8, 8), std::invalid_argument);
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
  EXPECT_EQ(s[1].longest->length, 16384);

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

  const std::string md = dcp::attention_bench_markdown_tables(pts, s, {});
  EXPECT_NE(md.find("skipped: needs 99.0 GB > --max-bytes 1.0 GB"), std::string::npos) << md;
  EXPECT_NE(md.find("8K (interpolated 4506)"), std::string::npos) << md;
  EXPECT_NE(md.find("none up to 8K"), std::string::npos) << md;
  EXPECT_NE(md.find("(0.55x)"), std::string::npos) << md;  // stationary at 8K
  const std::string csv = dcp::attention_bench_csv(pts, {});
  EXPECT_NE(csv.find("stationary,fp32,8192,measured,1,0.000072,0.000108,0.000180,0.5500,,0,0,,,,8192000000,"),
            std::string::npos)
      << csv;
  EXPECT_NE(csv.find("fixed,fp32,8192,skipped,,,,,,,0,0,,,,,,0,,,\"a run at 4096"), std::string::npos) << csv;
}

TEST(AttentionBench, CountsCausalFlopsForSoftmaxAndTheCostModelsForFlexformer) {
  auto o = tiny({1024});
  o.heads = 4;
  o.head_dim = 32;
  for (const char* v : {"softmax", "softmax-reference"}) {
    const auto f = dcp::attention_bench_flops(o, v, 1024);
    EXPECT_DOUBLE_EQ(f.forward, 4.0 * (1024.0 * 1024.0 / 2) * 32 * 4) << v;
    EXPECT_DOUBLE_EQ(f.backward, 2.5 * f.forward) << v;
    EXPECT_DOUBLE_EQ(f.forward + f.backward, 3.5 * 2 * 1024.0 * 1024.0 * 32 * 4) << v;
    EXPECT_EQ(f.source, "causal");
  }
  // A(s) = H s (2 C F + 2 C D' + 4 F D' + 4 P D) with F = 2m + 1 (shift), D' = D + 1, P = m, 2m or 0.
  const double H = 4, s = 1024, C = 16, D = 32, Dv = 33, m = 8;
  const std::map<std::string, std::pair<double, double>> fp = {
      {"stationary", {2 * m + 1, m}}, {"fixed", {2 * m + 1, m}}, {"nonstationary", {2 * m + 1, 2 * m}},
      {"elu", {D + 1, 0}}};
  for (const auto& [v, f_p] : fp) {
    const auto [F, P] = f_p;
    const auto f = dcp::attention_bench_flops(o, v, 1024);
    EXPECT_NEAR(f.forward, H * s * (2 * C * F + 2 * C * Dv + 4 * F * Dv + 4 * P * D), 1e-6 * f.forward) << v;
    EXPECT_DOUBLE_EQ(f.backward, 2 * f.forward) << v;
    EXPECT_EQ(f.source, "cost model") << v;
  }
  EXPECT_THROW(dcp::attention_bench_flops(o, "cosine", 1024), std::invalid_argument);
  EXPECT_THROW(dcp::attention_bench_flops(o, "softmax", 0), std::invalid_argument);
}

TEST(AttentionBenchReport, RatesFractionsOfPeakAndMemoryRatios) {
  EXPECT_DOUBLE_EQ(dcp::achieved_gflops(7e9, 2.0), 3.5);
  EXPECT_THROW(dcp::achieved_gflops(1e9, 0.0), std::invalid_argument);
  EXPECT_THROW(dcp::achieved_gflops(-1.0, 1.0), std::invalid_argument);

  dcp::MatmulPeak peak;
  peak.fp32_gflops = 100;
  peak.bf16_gflops = 400;
  AttentionBenchPoint p = measured("softmax", 4096, 2.0);
  p.flops = {40e9, 100e9, "causal"};  // 140 GFLOP in 2 s: 70 GFLOP/s
  EXPECT_DOUBLE_EQ(*dcp::point_gflops(p), 70);
  EXPECT_DOUBLE_EQ(*dcp::fraction_of_peak(p, peak), 0.7);
  p.dtype = "bf16";
  EXPECT_DOUBLE_EQ(*dcp::fraction_of_peak(p, peak), 70.0 / 400);
  EXPECT_FALSE(dcp::fraction_of_peak(p, dcp::MatmulPeak{}));  // no peak measured
  p.dtype = "fp16";
  EXPECT_THROW(dcp::fraction_of_peak(p, peak), std::invalid_argument);
  EXPECT_FALSE(dcp::point_gflops(skipped("softmax", 4096, "needs more")));

  // IO: 8 tensors [L, H, D] of the element size and the [L, H] fp32 logsumexp.
  EXPECT_DOUBLE_EQ(dcp::attention_io_bytes(1000, 2, 8, 4), 1000.0 * 2 * (8 * 8 * 4 + 4));
  EXPECT_DOUBLE_EQ(dcp::attention_io_bytes(1000, 2, 8, 2), 1000.0 * 2 * (8 * 8 * 2 + 4));
  EXPECT_THROW(dcp::attention_io_bytes(1000, 2, 8, 3), std::invalid_argument);
  p.dtype = "fp32";
  p.io_bytes = 1000;
  p.input_bytes = 500;
  p.peak_bytes = 700;
  EXPECT_DOUBLE_EQ(*dcp::memory_ratio(p), 1.2);
  EXPECT_FALSE(dcp::memory_ratio(skipped("softmax", 4096, "needs more")));

  // The tiled softmax's speedup over its reference, at lengths where both were measured.
  const std::vector<AttentionBenchPoint> pts = {measured("softmax", 1024, 0.5), measured("softmax-reference", 1024, 10),
                                                measured("softmax", 2048, 1.0),
                                                skipped("softmax-reference", 2048, "needs more")};
  EXPECT_DOUBLE_EQ(*dcp::speedup_over_reference(pts, 1024), 20);
  EXPECT_FALSE(dcp::speedup_over_reference(pts, 2048));
  EXPECT_FALSE(dcp::speedup_over_reference(pts, 4096));
}

TEST(AttentionBenchReport, TablesAndCsvCarryEveryColumn) {
  dcp::MatmulPeak peak;
  peak.size = 2048;
  peak.fp32_gflops = 100;
  peak.bf16_gflops = 400;
  std::vector<AttentionBenchPoint> pts;
  for (int64_t len : {4096, 8192}) {
    AttentionBenchPoint t = measured("softmax", len, 1e-9 * len * len);
    t.flops = {2.0 * len * len * 128, 5.0 * len * len * 128, "causal"};
    t.input_bytes = 4.0 * len * 128 * 4;
    t.peak_bytes = 4.4 * len * 128 * 4;
    t.io_bytes = dcp::attention_io_bytes(len, 4, 32, 4);
    pts.push_back(t);
    AttentionBenchPoint r = t;
    r.variant = "softmax-reference";
    r.seconds = 25 * t.seconds;
    r.peak_bytes = 12.0 * len * len * 4;
    pts.push_back(r);
  }
  const auto s = dcp::summarize_attention_bench(pts);
  ASSERT_EQ(s.size(), 2u);
  EXPECT_NEAR(*s[0].slope, 2.0, 1e-9);
  EXPECT_NEAR(*s[0].memory_slope, 1.0, 1e-9);  // inputs + peak, both linear
  EXPECT_FALSE(s[1].crossover);  // the reference is compared by its speedup, not a crossover
  EXPECT_GT(*s[1].memory_slope, 1.5);
  const std::string md = dcp::attention_bench_markdown_tables(pts, s, peak);
  for (const char* column : {"| forward | backward | fwd+bwd | vs softmax | GFLOP/s (fwd, bwd) | % of peak | peak memory "
                             "| memory ratio |",
                             "| length | softmax | softmax-reference | speedup |", "memory slope", "% of peak there",
                             "memory ratio there"}) {
    EXPECT_NE(md.find(column), std::string::npos) << column << "\n" << md;
  }
  // softmax at 4K: 7 x 4096^2 x 128 FLOPs in 4096^2 ns = 896 GFLOP/s (256 fwd in 0.4 of the time: 640; bwd
  // 1066.7), 896% of the fp32 peak; memory (4 + 4.4) x 128 B / (8 x 128 + 4) B per token and head = 1.05x.
  EXPECT_NE(md.find("| softmax | 4096 | 6.7 ms | 10.1 ms | 16.8 ms | - | 896.0 (640.0, 1066.7) | 896.0% | 9.2 MB | "
                    "1.05x |"),
            std::string::npos)
      << md;
  EXPECT_NE(md.find("| 4096 | 16.8 ms | 419.4 ms | 25.00x |"), std::string::npos) << md;
  const std::string csv = dcp::attention_bench_csv(pts, peak);
  EXPECT_EQ(csv.substr(0, csv.find('\n')),
            "variant,dtype,length,status,runs,forward_seconds,backward_seconds,seconds,time_ratio_to_softmax,"
            "speedup_over_reference,forward_flops,backward_flops,flops_source,gflops,fraction_of_peak,peak_bytes,"
            "input_bytes,io_bytes,memory_ratio,predicted_bytes,skip_reason");
  EXPECT_NE(csv.find("softmax,fp32,4096,measured,1,0.006711,0.010066,0.016777,1.0000,25.0000,4294967296,"
                     "10737418240,causal,896.000,8.96000,9227469,8388608,16842752,1.0459,,\"\""),
            std::string::npos)
      << csv;
}

TEST(AttentionBench, MeasuresTheMatmulPeakOfBothDtypes) {
  torch::set_num_threads(1);
  const auto peak = dcp::measure_matmul_peak(128, 2);
  EXPECT_EQ(peak.size, 128);
  EXPECT_EQ(peak.threads, 1);
  EXPECT_EQ(peak.runs, 2);
  for (double g : {peak.fp32_gflops, peak.bf16_gflops}) {
    EXPECT_TRUE(std::isfinite(g) && g > 0) << g;
  }
  EXPECT_THROW(dcp::measure_matmul_peak(0, 2), std::invalid_argument);
  EXPECT_THROW(dcp::measure_matmul_peak(128, 0), std::invalid_argument);
}
