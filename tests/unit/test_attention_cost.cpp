// The cost and memory models of linear (Flexformer) attention, the config -> shape mapping, and what the
// planners make of a linear-attention model.
#include <gtest/gtest.h>

#include <map>

#include "dcp/flexformer.h"
#include "dcp/planning.h"

namespace dcp {
namespace {

const DeviceSpec kH200 = DeviceSpec::named("h200");

// The 1.3B decoder with Flexformer's default operator: m = 64 stationary, shift, chunk 64.
ModelShape linear_1p3b() {
  AttentionConfig a;
  a.backend = "flexformer";
  return with_attention(ModelShape{}, a);
}

DeviceSpec no_fixed_costs() {
  DeviceSpec d = kH200;
  d.micro_batch_overhead_s = 0;
  d.collective_latency_s = 0;
  return d;
}

TEST(LinearAttentionCost, WorkIsExactlyLinearInLength) {
  const CostModel cost(linear_1p3b(), no_fixed_costs());
  for (int64_t r : {0, 5, 24}) {
    for (int64_t s : {1, 100, 4096, 1 << 20}) {
      EXPECT_NEAR(cost.work_seconds(2 * s, 1, r), 2 * cost.work_seconds(s, 1, r), 1e-12 * cost.work_seconds(s, 1, r))
          << s << " r " << r;
      const FlopCount one = cost.flops({2 * s}, r), two = cost.flops({s, s}, r);
      EXPECT_DOUBLE_EQ(one.attention, two.attention) << s;
    }
    // With communication too: every term of work is linear in s at any sp.
    EXPECT_NEAR(cost.work_seconds(200'000, 8, r), 2 * cost.work_seconds(100'000, 8, r),
                1e-12 * cost.work_seconds(100'000, 8, r));
  }
  // The softmax model of the same shape is not (its s^2 term).
  const CostModel softmax(ModelShape{}, no_fixed_costs());
  EXPECT_GT(softmax.work_seconds(2 * 65536, 1, 0), 2.5 * softmax.work_seconds(65536, 1, 0));
}

TEST(LinearAttentionCost, FlopsMatchAHandCount) {
  ModelShape m;
  m.hidden = 8, m.layers = 2, m.heads = 2, m.ffn = 16, m.vocab = 11;  // head_dim D = 4, D' = 5
  m.attention = AttentionKind::kLinear;
  m.feature_dim = 5, m.feature_projections = 2, m.chunk_size = 3;
  const CostModel cost(m, kH200);
  // Per head and token forward: 2 C F + 2 C D' + 4 F D' + 4 P D = 30 + 30 + 100 + 32 = 192; x 2 heads x 10
  // tokens = 3840; (3 L + r) = 7 forward passes' worth with r = 1.
  EXPECT_DOUBLE_EQ(cost.flops({10}, 1).attention, 7 * 3840.0);
  // Quadratic form (one chunk per sample): per head 2 s^2 (F + D') + 4 P D s = 2000 + 320.
  m.chunk_size = 0;
  EXPECT_DOUBLE_EQ(CostModel(m, kH200).flops({10}, 1).attention, 7 * 2 * 2320.0);
  // Softmax keeps its formula: (6 L + 2 r) h s^2; the linear layers do not depend on the attention kind.
  m.attention = AttentionKind::kSoftmax;
  EXPECT_DOUBLE_EQ(CostModel(m, kH200).flops({10}, 1).attention, (6 * 2 + 2) * 8 * 100.0);
  EXPECT_DOUBLE_EQ(CostModel(m, kH200).flops({10}, 1).linear, cost.flops({10}, 1).linear);

  m.attention = AttentionKind::kLinear;
  m.feature_dim = 0;
  EXPECT_THROW(CostModel(m, kH200), std::invalid_argument);
}

TEST(LinearAttentionCost, SequenceParallelSplitsItsHeadsLikeSoftmax) {
  // Both kinds move the same q, k, v, o all-to-alls, so the difference of their work is attention compute
  // alone, divided by sp.
  const CostModel lin(linear_1p3b(), kH200), soft(ModelShape{}, kH200);
  const int64_t s = 300'000;
  const double at1 = soft.work_seconds(s, 1, 3) - lin.work_seconds(s, 1, 3);
  for (int64_t sp : {2, 8, 16}) {
    EXPECT_NEAR((soft.work_seconds(s, sp, 3) - lin.work_seconds(s, sp, 3)) * static_cast<double>(sp), at1,
                1e-9 * at1);
  }
}

TEST(LinearAttentionMemory, AnalyticBytesAddTheOperatorsFp32TensorsAndNoSquares) {
  const ModelShape lin = linear_1p3b();
  const MemoryModel soft_m(ModelShape{}, kH200), lin_m(lin, kH200);
  const double H = 16, F = 129, Dv = 129, C = 64, P = 64;
  const double extra = 4 * H * (2 * F + Dv + C + F * Dv / C + 2 * P);
  EXPECT_DOUBLE_EQ(lin_m.coefficients().token_layer_bytes, soft_m.coefficients().token_layer_bytes + extra);
  EXPECT_DOUBLE_EQ(lin_m.coefficients().token_bytes, soft_m.coefficients().token_bytes + extra);
  EXPECT_DOUBLE_EQ(lin_m.coefficients().token_recompute_bytes, soft_m.coefficients().token_recompute_bytes);
  EXPECT_EQ(lin_m.coefficients().square_layer_bytes, 0);
  EXPECT_DOUBLE_EQ(lin_m.bytes(100'000, 4, 2), lin_m.bytes(std::vector<int64_t>{100'000}, 4, 2));
  // The quadratic reference form keeps [H, s, s] fp32 scores.
  ModelShape quad = lin;
  quad.chunk_size = 0;
  EXPECT_DOUBLE_EQ(MemoryModel(quad, kH200).coefficients().square_layer_bytes, 4 * H);
}

TEST(LinearAttentionConfig, ShapeFollowsTheBackendAndAgreesWithTheModule) {
  Config cfg;
  cfg.model.d_model = 64, cfg.model.n_heads = 4;  // head_dim 16
  EXPECT_EQ(model_shape_of(cfg).attention, AttentionKind::kSoftmax);
  cfg.attention.backend = "flexformer";
  cfg.attention.num_features = 8;
  cfg.attention.chunk_size = 32;
  for (const char* map : {"stationary", "nonstationary", "fixed", "elu"}) {
    for (const char* norm : {"shift", "clamp", "none"}) {
      cfg.attention.feature_map = map;
      cfg.attention.normalizer = norm;
      const ModelShape s = model_shape_of(cfg, 4);
      EXPECT_EQ(s.attention, AttentionKind::kLinear);
      EXPECT_EQ(s.bytes_per_element, 4);
      FlexformerAttention module(FlexformerOptions::from_config(cfg.attention), 4, 16);
      EXPECT_EQ(s.feature_dim, module.feature_dim()) << map << " " << norm;
      const int64_t rows = (module.omega.defined() ? module.omega.size(1) : 0) +
                           (module.omega2.defined() ? module.omega2.size(1) : 0);
      EXPECT_EQ(s.feature_projections, rows) << map;
    }
  }
  const std::map<std::string, int64_t> chunk_of_mode = {{"chunk", 32}, {"recurrent", 1}, {"quadratic", 0}};
  for (const auto& [mode, chunk] : chunk_of_mode) {
    cfg.attention.mode = mode;
    EXPECT_EQ(model_shape_of(cfg).chunk_size, chunk) << mode;
  }
  cfg.attention.backend = "softmax";
  const ModelShape back = model_shape_of(cfg);
  EXPECT_EQ(back.attention, AttentionKind::kSoftmax);
  EXPECT_EQ(back.feature_dim, 0);
  cfg.attention.backend = "mamba";
  EXPECT_THROW(model_shape_of(cfg), std::invalid_argument);
}

// Per SP size: tokens of the micro-batches that ran there, over the whole epoch.
std::map<int64_t, int64_t> tokens_by_sp(const PlanSet& set) {
  std::map<int64_t, int64_t> out;
  for (const auto& step : set.steps)
    for (const auto& g : step.groups)
      for (const auto& mb : g.micro_batches) out[g.sp_size] += mb.num_tokens;
  return out;
}

TEST(LinearAttentionPlans, DcpOptPlansDifferFromSoftmaxAndBothAreValid) {
  // A long-tailed step: many short samples and a few long ones.
  std::vector<int64_t> lengths(120, 4000);
  for (int64_t len : {60'000, 120'000, 250'000, 250'000}) lengths.push_back(len);
  const auto samples = samples_from_lengths(lengths, "x");
  const int64_t world = 16;
  PlannerOptions opt;
  opt.samples_per_step = static_cast<int64_t>(lengths.size());
  std::map<AttentionKind, PlanSet> plans;
  std::map<AttentionKind, double> step_s;
  for (const ModelShape& shape : {ModelShape{}, linear_1p3b()}) {
    const CostModel cost(shape, kH200);
    const MemoryModel memory(shape, kH200);
    const PlanSet set = plan_dcp_opt(samples, world, cost, memory, opt);
    ASSERT_TRUE(set.skipped_ids.empty());
    ASSERT_EQ(set.steps.size(), 1u);
    ASSERT_NO_THROW(set.steps[0].validate(world, samples, shape.layers));
    const StepCost c = evaluate_step(set.steps[0], samples, world, cost, memory);
    EXPECT_LE(c.peak_bytes, memory.budget_bytes());
    // The lower bound (additive work, no convexity assumed) stays a bound for linear attention.
    EXPECT_LE(step_lower_bound(set.steps[0].sample_ids(), samples, world, cost, memory), c.step_s * (1 + 1e-12));
    plans[shape.attention] = set;
    step_s[shape.attention] = c.step_s;
  }
  const auto soft = tokens_by_sp(plans[AttentionKind::kSoftmax]);
  const auto lin = tokens_by_sp(plans[AttentionKind::kLinear]);
  EXPECT_NE(soft, lin);
  // Long samples cost in proportion to their tokens, so fewer tokens need the large groups softmax gives them.
  auto mean_sp = [](const std::map<int64_t, int64_t>& m) {
    double tokens = 0, weighted = 0;
    for (const auto& [sp, t] : m) tokens += static_cast<double>(t), weighted += static_cast<double>(sp * t);
    return weighted / tokens;
  };
  EXPECT_LT(mean_sp(lin), mean_sp(soft));
  EXPECT_LT(step_s[AttentionKind::kLinear], step_s[AttentionKind::kSoftmax]);
}

}  // namespace
}  // namespace dcp
