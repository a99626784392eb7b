// Ring and ulysses-ring in the cost model (CostModel class comment), the layouts planners may use, dcp-opt's
// choice of mode per group, and the profile's ring fits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <set>
#include <fstream>
#include <string>

#include "dcp/planners.h"
#include "unit/error_of.h"

using namespace dcp;

namespace {

// The 1.3B decoder with 32 heads of 64 and `kv` KV heads.
ModelShape gqa_shape(int64_t kv) {
  ModelShape s;
  s.heads = 32;
  s.kv_heads = kv;
  return s;
}

// The h200 model with the latencies and the ring block efficiency out of the way, so that a test sees one term.
DeviceSpec bare_h200() {
  DeviceSpec d = DeviceSpec::named("h200");
  d.collective_latency_s = 0;
  d.ring_block_efficiency = 1;
  return d;
}

// Per step and layer forward: a rank's block attention (causal 2 h s^2 FLOPs over sp x R blocks) and the
// transfer of its K, V block (2 (s / sp) d_kv bytes of bf16), by hand.
double block_compute_s(const ModelShape& m, const DeviceSpec& d, double s, double sp, double ring) {
  return 2.0 * static_cast<double>(m.hidden) * s * s / (sp * ring * d.peak_flops * d.mfu * d.ring_block_efficiency);
}
double block_transfer_s(const ModelShape& m, double s, double sp, double bw) {
  return 2.0 * (s / sp) * m.kv_dim() * 2.0 / bw;
}

}  // namespace

TEST(RingCost, BlockBytesStepsAndGqaVolumes) {
  const ModelShape m = gqa_shape(8);  // d_kv = 8 x 64 = 512
  const CostModel cost(m, bare_h200());
  EXPECT_DOUBLE_EQ(m.kv_dim(), 512.0);
  // A block: K and V of the rank's 65536 / 8 tokens, 2 bytes each; ulysses-ring splits a subgroup's longer
  // chunks over its heads, which leaves the same bytes.
  EXPECT_DOUBLE_EQ(cost.ring_block_bytes(65536, SpLayout{8, 1}), 2.0 * 8192 * 512 * 2);
  EXPECT_DOUBLE_EQ(cost.ring_block_bytes(65536, SpLayout{8, 4}), 2.0 * 8192 * 512 * 2);
  EXPECT_EQ(cost.ring_block_bytes(65536, SpLayout{8, 8}), 0.0);
  // Forward and recomputed layers R - 1 hops, backward R - 1 plus the dK, dV hop home.
  EXPECT_EQ(cost.ring_steps(SpLayout{8, 1}, 2), (24 + 2) * 7 + 24 * 8);
  EXPECT_EQ(cost.ring_steps(SpLayout{16, 8}, 0), 24 * 1 + 24 * 2);
  EXPECT_EQ(cost.ring_steps(SpLayout{8, 8}, 0), 0);
  // Ulysses with GQA moves q, k, v and the output: (2 L + r) 2 (h + d_kv) elements per local token.
  EXPECT_DOUBLE_EQ(cost.all_to_all_bytes(65536, 8, 2), (2.0 * 24 + 2) * 2 * (2048 + 512) * 8192 * 2);
  // K and V projections shrink with the KV heads.
  EXPECT_DOUBLE_EQ(m.params_per_layer(), 2.0 * 2048 * 2048 + 2.0 * 2048 * 512 + 2.0 * 2048 * 8192);
  EXPECT_DOUBLE_EQ(gqa_shape(0).params_per_layer(), ModelShape{}.params_per_layer());
  ModelShape bad = gqa_shape(5);
  EXPECT_THROW(bad.validate(), std::invalid_argument);
}

TEST(RingCost, LongBlocksHideTheirTransferShortOnesDoNot) {
  const ModelShape m = gqa_shape(32);
  const DeviceSpec d = bare_h200();
  const CostModel cost(m, d);
  const SpLayout ring{8, 1};
  const double L = 24;
  // 256k tokens on 8 NVLink ranks: a block computes far longer than it travels, so only the last dK, dV hop of
  // each layer's backward shows.
  {
    const double s = 262144, tc = block_compute_s(m, d, s, 8, 8), tx = block_transfer_s(m, s, 8, d.intra_node_bw);
    ASSERT_GT(tc, tx);
    EXPECT_NEAR(cost.ring_exposed_seconds(262144, ring, 0), L * tx, 1e-12);
  }
  // 4k tokens: the block's 512 x 4096 attention is shorter than its transfer, which shows in every step.
  {
    const double s = 4096, tc = block_compute_s(m, d, s, 8, 8), tx = block_transfer_s(m, s, 8, d.intra_node_bw);
    ASSERT_LT(tc, tx);
    EXPECT_NEAR(cost.ring_exposed_seconds(4096, ring, 3), (3 * L + 3) * 7 * (tx - tc) + L * tx, 1e-15);
  }
  // Exposed communication per token falls with the length once the blocks are long enough.
  EXPECT_LT(cost.ring_exposed_seconds(262144, ring, 0) / 262144, cost.ring_exposed_seconds(4096, ring, 0) / 4096);
  EXPECT_EQ(cost.ring_exposed_seconds(4096, SpLayout{8, 8}, 0), 0.0);
}

TEST(RingCost, RingAcrossNodesPaysInfiniBandAndFitsReplaceTheDefaults) {
  const ModelShape m = gqa_shape(32);
  DeviceSpec d = bare_h200();
  const CostModel cost(m, d);
  EXPECT_EQ(cost.ring_bandwidth(8), d.intra_node_bw);
  EXPECT_EQ(cost.ring_bandwidth(16), d.inter_node_bw);
  // 32k tokens: on 8 ranks the transfer hides, on 16 across InfiniBand it does not.
  const double s = 32768;
  ASSERT_GT(block_compute_s(m, d, s, 8, 8), block_transfer_s(m, s, 8, d.intra_node_bw));
  ASSERT_LT(block_compute_s(m, d, s, 16, 16), block_transfer_s(m, s, 16, d.inter_node_bw));
  EXPECT_NEAR(cost.ring_exposed_seconds(32768, SpLayout{8, 1}, 0), 24 * block_transfer_s(m, s, 8, d.intra_node_bw),
              1e-15);
  EXPECT_GT(cost.ring_exposed_seconds(32768, SpLayout{16, 1}, 0), 24 * block_transfer_s(m, s, 16, d.inter_node_bw));
  // USP placement: Ulysses inside a node, ring across; the ring's steps are those of 2 positions.
  const double tc = block_compute_s(m, d, s, 16, 2), tx = block_transfer_s(m, s, 16, d.inter_node_bw);
  EXPECT_NEAR(cost.ring_exposed_seconds(32768, SpLayout{16, 8}, 0), 3 * 24 * std::max(0.0, tx - tc) + 24 * tx, 1e-15);

  // A fitted ring of sp 16 replaces bandwidth and latency; its latency counts once per ring step.
  d.ring[16] = CommFit{20e-6, 30e9, 0};
  d.micro_batch_overhead_s = 1e-3;
  const CostModel fitted(m, d);
  EXPECT_EQ(fitted.ring_bandwidth(16), 30e9);
  EXPECT_EQ(fitted.ring_latency(16), 20e-6);
  EXPECT_EQ(fitted.ring_latency(8), 0.0);
  EXPECT_DOUBLE_EQ(fitted.fixed_seconds(SpLayout{16, 1}, 2), 1e-3 + ((24 + 2) * 15 + 24 * 16) * 20e-6);
  d.ring[16].bytes_per_s = 0;
  EXPECT_THROW(CostModel(m, d), std::invalid_argument);
}

TEST(RingCost, WorkIsComputeAtBlockEfficiencyPlusExposedTransfer) {
  const ModelShape m = gqa_shape(8);
  DeviceSpec d = bare_h200();
  d.ring_block_efficiency = 0.8;
  const CostModel cost(m, d);
  const int64_t s = 65536, r = 4;
  const FlopCount f = cost.flops({s}, r);
  // Ulysses over 8 ranks: compute plus the all-to-all bytes leaving the rank.
  const double ulysses_comm = cost.all_to_all_bytes(s, 8, r) * 7.0 / 8.0 / d.intra_node_bw;
  const double compute = cost.work_seconds(s, SpLayout{8, 8}, r) - ulysses_comm;
  EXPECT_NEAR(compute, (f.linear + f.attention) / (8 * d.peak_flops * d.mfu), 1e-12);
  // Ring over 8: the same FLOPs with attention at 0.8 of its rate, and the exposed ring transfer.
  const double ring_compute = compute + f.attention / (8 * d.peak_flops * d.mfu) * (1 / 0.8 - 1);
  EXPECT_NEAR(cost.work_seconds(s, SpLayout{8, 1}, r),
              ring_compute + cost.ring_exposed_seconds(s, SpLayout{8, 1}, r), 1e-12);
  // Ulysses-ring 16 = 4 x 4: the all-to-all inside subgroups of 4 over the rank's s / 16 tokens, and the ring.
  const double sub_comm = (2.0 * 24 + r) * 2 * (2048 + 512) * (s / 16.0) * 2 * 3.0 / 4.0 / d.intra_node_bw;
  const double compute16 = (f.linear + f.attention / 0.8) / (16 * d.peak_flops * d.mfu);
  EXPECT_NEAR(cost.work_seconds(s, SpLayout{16, 4}, r),
              compute16 + sub_comm + cost.ring_exposed_seconds(s, SpLayout{16, 4}, r), 1e-12);
  EXPECT_DOUBLE_EQ(cost.seconds({s, 100}, SpLayout{16, 4}, r),
                   cost.fixed_seconds(SpLayout{16, 4}, r) + cost.work_seconds(s, SpLayout{16, 4}, r) +
                       cost.work_seconds(100, SpLayout{16, 4}, r));
  // The Ulysses overloads are SpLayout{sp, sp}.
  EXPECT_DOUBLE_EQ(cost.seconds({s}, 8, r), cost.seconds({s}, SpLayout{8, 8}, r));
}

// The table form of work_seconds (dcp-opt's tables of every sample at every layout, computed row by row with
// the factors of a row and of an SP size shared) against its reference, one work_seconds call per entry: the
// same bits (EXPECT_EQ on doubles, no tolerance: dcp-opt's plans compare these values and must not change),
// entries with a negative recompute count left alone, and the same errors. Shapes: the 1.3B decoder, GQA with
// 4 KV heads, the reference softmax and chunked linear attention; devices: h200, and h200 with fitted
// all-to-all and ring curves (overheads, latencies), an attention MFU of its own and a ring block efficiency.
TEST(RingCost, WorkSecondsTableMatchesSingleCalls) {
  ModelShape reference;
  reference.attention = AttentionKind::kSoftmaxReference;
  ModelShape linear;
  linear.attention = AttentionKind::kLinear;
  linear.feature_dim = 33, linear.feature_projections = 16, linear.chunk_size = 64;
  DeviceSpec fitted = DeviceSpec::named("h200");
  fitted.attention_mfu = 0.31, fitted.ring_block_efficiency = 0.85;
  for (int64_t sp : {2, 4, 8, 16, 64}) {
    fitted.all_to_all[sp] = CommFit{1e-5 * static_cast<double>(sp), 1e11 / static_cast<double>(sp), 3e-13};
    fitted.ring[sp] = CommFit{2e-5, 2e11 / static_cast<double>(sp), 0};
  }
  const std::vector<int64_t> lengths = {1, 2, 3, 100, 1024, 1024, 4095, 8192, 12345, 65536, 131071, 262144, 1000003};
  size_t checked = 0;
  for (const ModelShape& shape : {ModelShape{}, gqa_shape(4), reference, linear}) {
    for (const DeviceSpec& device : {DeviceSpec::named("h200"), fitted}) {
      const CostModel cost(shape, device);
      const std::vector<SpLayout> layouts = sp_layouts_allowed(1024, cost, {});
      const size_t n = lengths.size(), K = layouts.size();
      std::vector<int64_t> r(n * K);
      for (size_t e = 0; e < n * K; ++e) r[e] = static_cast<int64_t>((e * 7 + e / K) % 27) - 2;  // -2 .. 24
      for (size_t e = 0; e < n * K; e += 5) r[e] = 0;  // the common case
      std::vector<double> out(n * K, -7.0);
      cost.work_seconds(lengths, layouts, r.data(), out.data());
      for (size_t i = 0; i < n; ++i) {
        for (size_t k = 0; k < K; ++k) {
          const size_t e = i * K + k;
          if (r[e] < 0) {
            EXPECT_EQ(out[e], -7.0) << "entry left alone, length " << lengths[i] << " layout " << k;
            continue;
          }
          EXPECT_EQ(out[e], cost.work_seconds(lengths[i], layouts[k], r[e]))
              << "length " << lengths[i] << " sp " << layouts[k].sp_size << " ulysses " << layouts[k].ulysses_size
              << " r " << r[e];
          ++checked;
        }
      }
      std::vector<int64_t> too_many(n * K, shape.layers + 1);
      EXPECT_THROW(cost.work_seconds(lengths, layouts, too_many.data(), out.data()), std::invalid_argument);
      std::vector<int64_t> zero(2 * K, 0);
      EXPECT_THROW(cost.work_seconds({5, 0}, layouts, zero.data(), out.data()), std::invalid_argument);
    }
  }
  EXPECT_GT(checked, 1000u);
}

TEST(RingCost, LayoutsThatCannotRunAreRefused) {
  const CostModel gqa(gqa_shape(4), bare_h200());
  EXPECT_TRUE(gqa.supports(SpLayout{4, 4}));
  EXPECT_FALSE(gqa.supports(SpLayout{8, 8}));  // Ulysses beyond the KV heads
  EXPECT_TRUE(gqa.supports(SpLayout{8, 1}));
  EXPECT_TRUE(gqa.supports(SpLayout{8, 2}));
  EXPECT_THROW(gqa.work_seconds(1024, SpLayout{8, 8}, 0), std::invalid_argument);
  EXPECT_THROW(gqa.fixed_seconds(SpLayout{8, 3}, 0), std::invalid_argument);
  ModelShape linear;
  linear.attention = AttentionKind::kLinear, linear.feature_dim = 64, linear.chunk_size = 64;
  const CostModel lin(linear, bare_h200());
  EXPECT_FALSE(lin.supports(SpLayout{4, 1}));
  EXPECT_FALSE(lin.supports(SpLayout{8, 4}));
  EXPECT_TRUE(lin.supports(SpLayout{4, 4}));
  const std::string e = test::error_of([&] { lin.seconds({1024}, SpLayout{4, 1}, 0); });
  EXPECT_NE(e.find("softmax"), std::string::npos) << e;
}

TEST(RingCost, LayoutsAllowedFollowModesHeadsAndNodes) {
  const CostModel gqa(gqa_shape(8), bare_h200());
  const auto all = sp_layouts_allowed(32, gqa, {});
  auto has = [&](const std::vector<SpLayout>& v, int64_t sp, int64_t u) {
    return std::any_of(v.begin(), v.end(), [&](const SpLayout& l) { return l.sp_size == sp && l.ulysses_size == u; });
  };
  EXPECT_TRUE(has(all, 1, 1));
  EXPECT_TRUE(has(all, 8, 8));
  EXPECT_FALSE(has(all, 16, 16));  // Ulysses is bounded by the 8 KV heads
  EXPECT_TRUE(has(all, 16, 1));
  EXPECT_TRUE(has(all, 16, 8));
  EXPECT_TRUE(has(all, 32, 8));
  EXPECT_TRUE(has(all, 3, 1));  // a ring takes any size
  for (size_t i = 1; i < all.size(); ++i) EXPECT_LE(all[i - 1].sp_size, all[i].sp_size);
  // MHA with 32 heads: the largest subgroup of 32 ranks is 16 (across nodes), and the one inside a node is 8.
  const CostModel mha(gqa_shape(32), bare_h200());
  const auto m = sp_layouts_allowed(64, mha, {SpMode::kUlyssesRing});
  EXPECT_TRUE(has(m, 32, 16));
  EXPECT_TRUE(has(m, 32, 8));
  EXPECT_FALSE(has(m, 32, 4));
  EXPECT_FALSE(has(m, 32, 32));
  EXPECT_FALSE(has(m, 32, 1));
  EXPECT_EQ(sp_layouts_allowed(64, mha, {SpMode::kUlysses}).back().sp_size, 32);
  // Linear attention: Ulysses only, and asking for a ring is an error.
  ModelShape linear;
  linear.attention = AttentionKind::kLinear, linear.feature_dim = 64, linear.chunk_size = 64;
  const CostModel lin(linear, bare_h200());
  for (const SpLayout& l : sp_layouts_allowed(32, lin, {})) EXPECT_EQ(l.ring_size(), 1);
  EXPECT_THROW(sp_layouts_allowed(32, lin, {SpMode::kRing}), std::invalid_argument);
  // Ulysses planners stay within the KV heads.
  EXPECT_EQ(sp_sizes_allowed(32, gqa_shape(8)).back(), 8);
}

// Samples that need more ranks than the KV heads allow Ulysses get ring or ulysses-ring groups; with Ulysses only
// they cannot be placed at all.
TEST(RingCost, DcpOptUsesRingModesWhereSpMustExceedTheKvHeads) {
  const ModelShape m = gqa_shape(4);
  const DeviceSpec d = DeviceSpec::named("h200");
  const CostModel cost(m, d);
  const MemoryModel memory(m, d);
  std::vector<int64_t> lengths(30, 4000);
  lengths.push_back(1'500'000);  // does not fit 4 ranks even with full recompute
  lengths.push_back(1'200'000);
  const auto samples = samples_from_lengths(lengths, "x");
  ASSERT_FALSE(memory.min_recompute_layers(1'500'000, 4));
  PlannerOptions opt;
  opt.samples_per_step = static_cast<int64_t>(lengths.size());
  const PlanSet set = plan_dcp_opt(samples, 32, cost, memory, opt);
  ASSERT_TRUE(set.skipped_ids.empty());
  ASSERT_EQ(set.steps.size(), 1u);
  ASSERT_NO_THROW(set.steps[0].validate(32, samples, m.layers));
  int ring_groups = 0;
  for (const auto& g : set.steps[0].groups) {
    if (g.sp_size > 4 && !g.micro_batches.empty()) {
      EXPECT_NE(g.sp_mode, SpMode::kUlysses) << "sp " << g.sp_size;
      ++ring_groups;
    }
    if (g.sp_mode == SpMode::kUlysses) EXPECT_EQ(4 % g.sp_size, 0) << g.sp_size;
    if (g.sp_mode == SpMode::kUlyssesRing) EXPECT_TRUE(cost.supports(g.layout()));
    for (const auto& mb : g.micro_batches) {
      // Short samples keep Ulysses or no SP: a ring does not pay for 4k tokens.
      if (mb.num_tokens <= 8000) EXPECT_TRUE(g.sp_size == 1 || g.sp_mode == SpMode::kUlysses) << g.sp_size;
    }
  }
  EXPECT_GE(ring_groups, 1);
  // The planner's own model prices the plan it made, and the bound over every mode holds.
  const StepCost c = evaluate_step(set.steps[0], samples, 32, cost, memory);
  EXPECT_LE(step_lower_bound(set.steps[0].sample_ids(), samples, 32, cost, memory), c.step_s * (1 + 1e-12));
  // Ulysses only: no size holds the long samples.
  opt.sp_modes = {SpMode::kUlysses};
  const PlanSet ulysses = plan_dcp_opt(samples, 32, cost, memory, opt);
  EXPECT_EQ(ulysses.skipped_ids.size(), 2u);
  for (const auto& g : ulysses.steps[0].groups) EXPECT_EQ(g.sp_mode, SpMode::kUlysses);
}

// Where Ulysses can run, the choice follows the model: intra-node Ulysses beats the ring at 90 % block
// efficiency, and a ring wins when the ring blocks lose nothing and hide their transfer.
TEST(RingCost, DcpOptPicksTheCheaperModeOfASize) {
  const ModelShape m = gqa_shape(32);
  DeviceSpec d = DeviceSpec::named("h200");
  const MemoryModel memory(m, d);
  const std::vector<int64_t> lengths(8, 1'000'000);
  const auto samples = samples_from_lengths(lengths, "x");
  PlannerOptions opt;
  opt.samples_per_step = 8;
  auto modes_of = [&](const CostModel& cost) {
    const PlanSet set = plan_dcp_opt(samples, 64, cost, memory, opt);
    EXPECT_TRUE(set.skipped_ids.empty());
    std::set<SpMode> modes;
    for (const auto& g : set.steps.at(0).groups) {
      if (g.sp_size > 1 && !g.micro_batches.empty()) modes.insert(g.sp_mode);
    }
    return modes;
  };
  const CostModel lossy(m, d);
  ASSERT_LT(lossy.seconds({1'000'000}, SpLayout{8, 8}, 0), lossy.seconds({1'000'000}, SpLayout{8, 1}, 0));
  EXPECT_EQ(modes_of(lossy), std::set<SpMode>{SpMode::kUlysses});
  d.ring_block_efficiency = 1;
  const CostModel ideal(m, d);
  ASSERT_GT(ideal.seconds({1'000'000}, SpLayout{8, 8}, 0), ideal.seconds({1'000'000}, SpLayout{8, 1}, 0));
  EXPECT_EQ(modes_of(ideal).count(SpMode::kUlysses), 0u);
}

// Every planner's plan runs: Ulysses groups never exceed the KV heads.
TEST(RingCost, EveryPlannerStaysWithinTheKvHeads) {
  const ModelShape m = gqa_shape(2);
  const DeviceSpec d = DeviceSpec::named("h200");
  const CostModel cost(m, d);
  const MemoryModel memory(m, d);
  std::vector<int64_t> lengths;
  for (int i = 0; i < 60; ++i) lengths.push_back(1000 + 7919 * i % 200'000);
  const auto samples = samples_from_lengths(lengths, "x");
  PlannerOptions opt;
  opt.tokens_per_step = 8 * 300'000;
  for (const auto& name : planner_names()) {
    const PlanSet set = planner_by_name(name)(samples, 8, cost, memory, opt);
    for (const auto& step : set.steps) {
      ASSERT_NO_THROW(step.validate(8, samples, m.layers)) << name;
      for (const auto& g : step.groups) EXPECT_TRUE(g.sp_size == 1 || cost.supports(g.layout())) << name;
    }
  }
}

namespace {

std::string write_profile(const std::string& name, const std::string& sequence_parallel) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path) << R"({"device": {"name": "cpu", "memory_bytes": 1e10, "peak_flops": 1e11, "mfu": 0.5,
    "attention_mfu": 0.3, "intra_node_bw": 1e9, "inter_node_bw": 1e9, "gpus_per_node": 1,
    "collective_latency_s": 1e-4, "micro_batch_overhead_s": 1e-3})"
                      << sequence_parallel << "}";
  return path;
}

}  // namespace

TEST(RingCost, ProfileRingFitsAreReadAndOldProfilesStillLoad) {
  const std::string fits = R"([{"sp_size": 2, "latency_s": 2e-4, "bytes_per_s": 3e9, "overhead_s_per_byte": 1e-10}])";
  const DeviceSpec with = DeviceSpec::from_profile(write_profile(
      "ring_fits.json", R"(, "sequence_parallel": {"fits": )" + fits +
                            R"(, "ring_fits": [{"sp_size": 2, "latency_s": 5e-5, "bytes_per_s": 2e9},
                                               {"sp_size": 4, "latency_s": 8e-5, "bytes_per_s": 1e9}]})"));
  ASSERT_EQ(with.ring.size(), 2u);
  EXPECT_EQ(with.ring.at(2).latency_s, 5e-5);
  EXPECT_EQ(with.ring.at(4).bytes_per_s, 1e9);
  EXPECT_EQ(with.ring.at(4).overhead_s_per_byte, 0.0);
  EXPECT_EQ(with.all_to_all.at(2).bytes_per_s, 3e9);
  EXPECT_EQ(with.ring_block_efficiency, 0.9);  // not in the file: the default
  // Written before the ring was profiled: all-to-alls only, or no SP at all.
  const DeviceSpec old = DeviceSpec::from_profile(
      write_profile("old_sp.json", R"(, "sequence_parallel": {"fits": )" + fits + "}"));
  EXPECT_TRUE(old.ring.empty());
  EXPECT_EQ(old.all_to_all.size(), 1u);
  EXPECT_TRUE(DeviceSpec::from_profile(write_profile("no_sp.json", "")).ring.empty());
  // Validated as the all-to-all fits are, naming the field.
  const std::string bad_rate = test::error_of([&] {
    DeviceSpec::from_profile(write_profile("bad_ring.json", R"(, "sequence_parallel": {"fits": [], "ring_fits":
        [{"sp_size": 2, "latency_s": 1e-5, "bytes_per_s": 0}]})"));
  });
  EXPECT_NE(bad_rate.find("sequence_parallel.ring_fits[0].bytes_per_s"), std::string::npos) << bad_rate;
  const std::string repeated = test::error_of([&] {
    DeviceSpec::from_profile(write_profile("rep_ring.json", R"(, "sequence_parallel": {"fits": [], "ring_fits":
        [{"sp_size": 2, "latency_s": 1e-5, "bytes_per_s": 1e9}, {"sp_size": 2, "latency_s": 1e-5, "bytes_per_s": 1e9}]})"));
  });
  EXPECT_NE(repeated.find("ring_fits[1].sp_size"), std::string::npos) << repeated;
  const std::string not_array = test::error_of([&] {
    DeviceSpec::from_profile(write_profile("arr_ring.json", R"(, "sequence_parallel": {"fits": [], "ring_fits": 3})"));
  });
  EXPECT_NE(not_array.find("sequence_parallel.ring_fits"), std::string::npos) << not_array;
  const std::string eff = test::error_of([&] {
    std::ofstream(::testing::TempDir() + "eff.json") << R"({"device": {"name": "cpu", "memory_bytes": 1e10,
      "peak_flops": 1e11, "mfu": 0.5, "attention_mfu": 0.3, "intra_node_bw": 1e9, "inter_node_bw": 1e9,
      "gpus_per_node": 1, "collective_latency_s": 1e-4, "micro_batch_overhead_s": 1e-3,
      "ring_block_efficiency": 1.5}})";
    DeviceSpec::from_profile(::testing::TempDir() + "eff.json");
  });
  EXPECT_NE(eff.find("ring_block_efficiency"), std::string::npos) << eff;
}
