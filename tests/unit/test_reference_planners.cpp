// The reference's planners (dcp-intra, dcp-inter, dcp-inter-pac): their solvers against brute force, their
// draws, non-power-of-two world sizes and hand-computed tiny steps. The properties every planner shares
// (each sample once, memory, determinism, lower bound) are in test_planners.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <random>

#include "dcp/planners.h"
#include "plan/bucket_profile.h"
#include "plan/gas_solver.h"
#include "plan/planner_common.h"
#include "plan/step_pool.h"

using namespace dcp;
using namespace dcp::planner_detail;

namespace {

const ModelShape kShape;  // 1.3B decoder, 16 heads
const DeviceSpec kH200 = DeviceSpec::named("h200");

// A tiny model on a tiny device, so that a bucket's bs is a handful of samples and brute force is cheap.
ModelShape tiny_shape() {
  ModelShape m;
  m.hidden = 64;
  m.layers = 4;
  m.heads = 4;
  m.ffn = 256;
  m.vocab = 256;
  return m;
}
DeviceSpec tiny_device() {
  DeviceSpec d = kH200;
  d.memory_bytes = 4e7;
  return d;
}

// The brute-force gas rule: the same target candidates in the same order, every g vector in the box, the
// least summed error (first target, then lexicographically first vector, on ties), then min-gas scaling.
std::vector<int64_t> brute_force_gas(const std::vector<double>& t, int64_t max_gas, int64_t min_gas,
                                     const std::vector<int64_t>& caps) {
  const size_t n = t.size();
  const double t_max = *std::max_element(t.begin(), t.end());
  std::vector<int64_t> hi(n);
  for (size_t i = 0; i < n; ++i) {
    hi[i] = std::max<int64_t>(1, static_cast<int64_t>(std::floor(max_gas * t_max / t[i] * (1 + 1e-9))));
    if (!caps.empty()) hi[i] = std::min(hi[i], caps[i]);
  }
  std::vector<double> taus;
  std::vector<double> seen;
  for (size_t o = 0; o < n; ++o) {
    if (std::find(seen.begin(), seen.end(), t[o]) != seen.end()) continue;
    seen.push_back(t[o]);
    for (int64_t m = 1; m <= hi[o]; ++m) taus.push_back(t[o] * static_cast<double>(m));
  }
  double best_total = 1e300;
  std::vector<int64_t> best;
  for (double tau : taus) {
    std::vector<int64_t> g(n, 1);
    while (true) {
      double total = 0;
      for (size_t i = 0; i < n; ++i) {
        const double d = t[i] * static_cast<double>(g[i]) - tau;
        total += d > 0 ? 1.2 * d : -d;
      }
      if (total < best_total) best_total = total, best = g;
      size_t i = n;  // odometer, last index fastest: vectors in lexicographic order
      while (i > 0 && ++g[i - 1] > hi[i - 1]) g[--i] = 1;
      if (i == 0) break;
    }
  }
  const int64_t top = *std::max_element(best.begin(), best.end());
  if (top < min_gas) {
    for (size_t i = 0; i < n; ++i) {
      best[i] *= (min_gas + top - 1) / top;
      if (!caps.empty()) best[i] = std::min(best[i], caps[i]);
    }
  }
  return best;
}

// Every sample once (placed or skipped), valid aligned power-of-two groups, memory within budget.
void expect_valid(const PlanSet& set, const std::vector<Sample>& samples, int64_t world, const CostModel& cost,
                  const MemoryModel& memory, const std::string& what) {
  std::vector<int> seen(samples.size(), 0);
  for (int64_t id : set.skipped_ids) ++seen[static_cast<size_t>(id)];
  for (const auto& step : set.steps) {
    ASSERT_NO_THROW(step.validate(world, samples, cost.shape().layers)) << what;
    for (const auto& g : step.groups) {
      EXPECT_EQ(g.sp_size & (g.sp_size - 1), 0) << what << " sp_size " << g.sp_size;
      EXPECT_EQ(cost.shape().heads % g.sp_size, 0) << what;
      for (const auto& mb : g.micro_batches) {
        EXPECT_FALSE(mb.sample_ids.empty()) << what;
        EXPECT_LE(memory.bytes(mb.num_tokens, g.sp_size, mb.recompute_layers), memory.budget_bytes()) << what;
      }
    }
    for (int64_t id : step.sample_ids()) ++seen[static_cast<size_t>(id)];
  }
  for (size_t i = 0; i < seen.size(); ++i) ASSERT_EQ(seen[i], 1) << what << " sample " << i;
}

std::vector<int64_t> mb_sizes(const GroupPlan& g) {
  std::vector<int64_t> out;
  for (const auto& mb : g.micro_batches) out.push_back(static_cast<int64_t>(mb.sample_ids.size()));
  return out;
}

}  // namespace

TEST(GasSolver, MatchesBruteForceOnSmallRandomInputs) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 400; ++trial) {
    const size_t n = 1 + trial % 4;
    std::vector<double> t(n);
    // Small integers make ties common, so the tie rules are exercised too; every fourth trial uses reals.
    for (auto& x : t) x = trial % 4 == 3 ? std::uniform_real_distribution<double>(0.1, 3.0)(rng)
                                         : static_cast<double>(1 + rng() % 6);
    const int64_t max_gas = 1 + trial % 5, min_gas = 1 + (trial / 5) % 4;
    std::vector<int64_t> caps;
    if (trial % 3 == 0) {
      for (size_t i = 0; i < n; ++i) caps.push_back(1 + static_cast<int64_t>(rng() % 6));
    }
    const auto got = solve_grad_accum_steps(t, max_gas, min_gas, caps);
    EXPECT_EQ(got, brute_force_gas(t, max_gas, min_gas, caps)) << "trial " << trial;
    // Before min-gas scaling the slowest group stays within max_gas; after it, all g >= 1.
    for (int64_t g : got) EXPECT_GE(g, 1);
  }
}

TEST(GasSolver, BalancesTimesWithTheOverPenaltyAndRejectsBadInput) {
  // Times 1 and 3: target 3 gives g = (3, 1) with no error.
  EXPECT_EQ(solve_grad_accum_steps({1.0, 3.0}, 5, 1), (std::vector<int64_t>{3, 1}));
  // Times 2 and 3, max_gas 1: the 3 s group is capped at 1, so the 2 s group may run 1 (under by 1, error 1)
  // or 2 (over by 1, error 1.2): the over-penalty picks 1.
  EXPECT_EQ(solve_grad_accum_steps({2.0, 3.0}, 1, 1), (std::vector<int64_t>{1, 1}));
  // min_gas 4 scales (3, 1) by ceil(4 / 3) = 2.
  EXPECT_EQ(solve_grad_accum_steps({1.0, 3.0}, 5, 4), (std::vector<int64_t>{6, 2}));
  EXPECT_TRUE(solve_grad_accum_steps({}, 5, 2).empty());
  EXPECT_THROW(solve_grad_accum_steps({1.0, 0.0}, 5, 2), std::invalid_argument);
  EXPECT_THROW(solve_grad_accum_steps({1.0}, 0, 2), std::invalid_argument);
  EXPECT_THROW(solve_grad_accum_steps({1.0}, 5, 0), std::invalid_argument);
  EXPECT_THROW(solve_grad_accum_steps({1.0}, 5, 2, {1, 2}), std::invalid_argument);
  EXPECT_THROW(solve_grad_accum_steps({1.0}, 5, 2, {0}), std::invalid_argument);
}

TEST(BucketProfile, PacChoiceMatchesBruteForceOnTinyCases) {
  const CostModel cost(tiny_shape(), tiny_device());
  const MemoryModel memory(tiny_shape(), tiny_device(), 0.9, 0);
  const std::vector<int64_t> sizes = {1, 2, 4};
  std::mt19937 rng(3);
  int feasible = 0;
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t length = 200 + static_cast<int64_t>(rng() % 30000);
    // Every (sp, bs, r) that fits memory, timed by the cost model itself.
    double best = 0;
    for (int64_t s : sizes) {
      for (int64_t r = 0; r <= tiny_shape().layers; ++r) {
        for (int64_t bs = 1; memory.bytes(bs * length, s, r) <= memory.budget_bytes(); ++bs) {
          const double thr = static_cast<double>(bs) /
                             (static_cast<double>(s) * cost.seconds(std::vector<int64_t>(bs, length), s, r));
          best = std::max(best, thr);
        }
      }
    }
    const BucketSetting got = best_pac_setting(length, sizes, cost, memory);
    if (best == 0) {
      EXPECT_EQ(got.bs, 0) << length;
      continue;
    }
    ++feasible;
    ASSERT_GE(got.bs, 1) << length;
    EXPECT_LE(memory.bytes(got.bs * length, got.sp_size, got.recompute_layers), memory.budget_bytes());
    EXPECT_NEAR(got.throughput(), best, 1e-9 * best) << "length " << length;
    EXPECT_NEAR(got.seconds(got.bs), cost.seconds(std::vector<int64_t>(got.bs, length), got.sp_size,
                                                  got.recompute_layers), 1e-12);
  }
  EXPECT_GE(feasible, 40);
}

TEST(BucketProfile, WithoutPacOneRecomputeCountFitsEveryBucket) {
  const CostModel cost(kShape, kH200);
  const MemoryModel memory(kShape, kH200);
  // 2100 and 2150 share the quarter-octave bucket (2^11, 2^11.25].
  const auto samples = samples_from_lengths({144, 2100, 2150, 50'000, 300'000, 432'000, 5'000'000}, "x");
  const ProfileTable t = profile_buckets(samples, 32, cost, memory, false);
  EXPECT_EQ(t.sizes, (std::vector<int64_t>{1, 2, 4, 8, 16}));
  EXPECT_EQ(skipped_ids(t.skipped), (std::vector<int64_t>{6}));  // fits not even 16 ranks
  ASSERT_EQ(t.buckets.size(), 5u);
  EXPECT_EQ(t.of(length_bucket(2100)).length, 2150);
  bool tight = false;
  for (const auto& [key, b] : t.buckets) {
    EXPECT_EQ(b.chosen.recompute_layers, t.recompute_layers);
    EXPECT_LE(memory.bytes(b.chosen.bs * b.length, b.chosen.sp_size, t.recompute_layers), memory.budget_bytes());
    EXPECT_GT(memory.bytes((b.chosen.bs + 1) * b.length, b.chosen.sp_size, t.recompute_layers),
              memory.budget_bytes()) << "bs is the most samples that fit";
    for (const auto& st : b.by_size) EXPECT_LE(st.throughput(), b.chosen.throughput());
    // The table starts at the smallest size that holds the bucket at all.
    const int64_t smallest = b.by_size.front().sp_size;
    if (smallest > 1) EXPECT_FALSE(memory.min_recompute_layers(b.length, smallest / 2).has_value());
    // The epoch-wide count is the fewest: some bucket does not fit its smallest size with one layer fewer.
    if (t.recompute_layers > 0 &&
        memory.bytes(b.length, smallest, t.recompute_layers - 1) > memory.budget_bytes()) {
      tight = true;
    }
  }
  EXPECT_TRUE(t.recompute_layers == 0 || tight);
  EXPECT_THROW(t.of(length_bucket(2100)).at(3), std::out_of_range);
}

TEST(StepPool, ClassDrawIsCumulativeByWorkAndSeeded) {
  const CostModel cost(kShape, kH200);
  const MemoryModel memory(kShape, kH200);
  // With PAC on 8 ranks: three buckets of SP class 1, one of class 2 and one of class 4. The reference's draw
  // compares one uniform number with each class's own probability (u < p1, else u < p2, else the last), so
  // it under-picks the middle class; the cumulative draw picks each class by its share of the work.
  const auto samples = samples_from_lengths({1000, 1000, 3000, 9000, 54'000, 108'000}, "x");
  const ProfileTable t = profile_buckets(samples, 8, cost, memory, true);
  std::map<int64_t, int64_t> buckets_of_class;
  std::map<int64_t, double> work;  // GPU-seconds of each class at its profiled settings
  double total = 0;
  for (const auto& s : samples) {
    const BucketSetting& st = t.of(length_bucket(s.length)).chosen;
    work[st.sp_size] += static_cast<double>(st.sp_size) * st.work_s;
    total += static_cast<double>(st.sp_size) * st.work_s;
  }
  for (const auto& [key, b] : t.buckets) ++buckets_of_class[b.chosen.sp_size];
  ASSERT_EQ(buckets_of_class, (std::map<int64_t, int64_t>{{1, 3}, {2, 1}, {4, 1}}));
  StepRng rng(1, 0, 0, 9);
  StepPool pool({0, 1, 2, 3, 4, 5}, samples, t, rng);
  std::map<int64_t, int64_t> drawn;
  const int n = 20000;
  for (int i = 0; i < n; ++i) ++drawn[t.of(*pool.draw(8, rng)).chosen.sp_size];
  for (const auto& [sp, w] : work) {
    EXPECT_NEAR(static_cast<double>(drawn[sp]) / n, w / total, 0.02) << "class " << sp;
  }
  // Classes above max_sp are never drawn.
  for (int i = 0; i < 200; ++i) EXPECT_EQ(t.of(*pool.draw(1, rng)).chosen.sp_size, 1);
  EXPECT_FALSE(pool.draw(0, rng).has_value());
  EXPECT_EQ(t.of(*pool.draw_largest(8, rng)).chosen.sp_size, 4);
  EXPECT_EQ(t.of(*pool.draw_largest(3, rng)).chosen.sp_size, 2);
  // The reference's weights (native iterations): each class by its number of buckets.
  StepPool by_buckets({0, 1, 2, 3, 4, 5}, samples, t, rng, true);
  std::map<int64_t, int64_t> drawn_by_buckets;
  for (int i = 0; i < n; ++i) ++drawn_by_buckets[t.of(*by_buckets.draw(8, rng)).chosen.sp_size];
  for (const auto& [sp, count] : buckets_of_class) {
    EXPECT_NEAR(static_cast<double>(drawn_by_buckets[sp]) / n, count / 5.0, 0.02) << "class " << sp;
  }
  // take and give_back keep every id exactly once.
  const int64_t key = length_bucket(1000);
  auto ids = pool.take(key, 5);
  EXPECT_EQ(ids.size(), 2u);
  EXPECT_EQ(pool.remaining(key), 0);
  pool.give_back(key, ids);
  EXPECT_EQ(pool.remaining(key), 2);
  EXPECT_EQ(pool.take(key, 1), (std::vector<int64_t>{ids[0]}));
}

TEST(ReferencePlanners, NonPowerOfTwoWorldSizes) {
  const CostModel cost(kShape, kH200);
  const MemoryModel memory(kShape, kH200);
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(std::log(100.0), std::log(3'000'000.0));
  std::vector<int64_t> lengths;
  for (int i = 0; i < 250; ++i) lengths.push_back(static_cast<int64_t>(std::exp(u(rng))));
  const auto samples = samples_from_lengths(lengths, "r");
  for (int64_t world : {3, 5, 6, 12}) {
    PlannerOptions opt;
    opt.tokens_per_step = world * 300'000;
    for (const char* name : {"dcp-intra", "dcp-inter", "dcp-inter-pac"}) {
      const PlanSet set = planner_by_name(name)(samples, world, cost, memory, opt);
      const std::string what = std::string(name) + " world " + std::to_string(world);
      expect_valid(set, samples, world, cost, memory, what);
      const int64_t largest = power_of_two_sizes(world, kShape).back();
      for (int64_t id : set.skipped_ids) {
        EXPECT_FALSE(memory.min_recompute_layers(samples[static_cast<size_t>(id)].length, largest)) << what;
      }
      EXPECT_FALSE(set.skipped_ids.empty()) << what << ": some samples are longer than any group holds";
      EXPECT_GT(set.steps.size(), 3u) << what;
    }
  }
}

TEST(ReferencePlanners, IntraGivesEachGroupOneMicroBatchWhenTheStepFitsOneRound) {
  const CostModel cost(kShape, kH200);
  const MemoryModel memory(kShape, kH200);
  // Buckets with fewer samples than their bs: every first micro-batch is a bucket tail, so nothing is
  // retargeted and the step is one round.
  const auto samples = samples_from_lengths({1000, 1000, 1000, 5000, 5000, 20'000, 300'000}, "x");
  PlannerOptions opt;
  opt.samples_per_step = 7;
  const PlanSet set = plan_dcp_intra(samples, 8, cost, memory, opt);
  ASSERT_EQ(set.steps.size(), 1u);
  expect_valid(set, samples, 8, cost, memory, "intra");
  int64_t busy = 0;
  for (const auto& g : set.steps[0].groups) {
    EXPECT_LE(g.micro_batches.size(), 1u) << "group at rank " << g.first_rank;
    if (!g.micro_batches.empty()) {
      ++busy;
      // One bucket per micro-batch.
      const auto& ids = g.micro_batches[0].sample_ids;
      for (int64_t id : ids) {
        EXPECT_EQ(length_bucket(samples[static_cast<size_t>(id)].length),
                  length_bucket(samples[static_cast<size_t>(ids[0])].length));
      }
    }
  }
  EXPECT_EQ(busy, 4) << "one group per bucket";

  // Twice as many samples as one round holds: the layout stays, rounds add micro-batches.
  std::vector<int64_t> many(40, 60'000);
  const auto more = samples_from_lengths(many, "y");
  opt.samples_per_step = 40;
  const PlanSet two = plan_dcp_intra(more, 2, cost, memory, opt);
  expect_valid(two, more, 2, cost, memory, "intra rounds");
  size_t most = 0;
  for (const auto& g : two.steps[0].groups) most = std::max(most, g.micro_batches.size());
  EXPECT_GT(most, 1u);
}

// PlannerOptions::native_iterations: the reference's own iterations over the epoch's pool, each one fill of the
// ranks. On the common steps dcp-intra's rounds give groups several micro-batches; natively each iteration gives
// a group at most one, so there are more iterations than steps; every sample stays planned once.
TEST(ReferencePlanners, NativeIterationsAreOneFillEach) {
  const CostModel cost(kShape, kH200);
  const MemoryModel memory(kShape, kH200);
  std::mt19937 rng(5);
  std::uniform_real_distribution<double> u(std::log(1000.0), std::log(400'000.0));
  std::vector<int64_t> lengths;
  for (int i = 0; i < 300; ++i) lengths.push_back(static_cast<int64_t>(std::exp(u(rng))));
  const auto samples = samples_from_lengths(lengths, "r");
  for (int64_t world : {8, 12}) {
    PlannerOptions opt;
    opt.tokens_per_step = world * 1'000'000;
    for (const char* name : {"dcp-intra", "dcp-inter", "dcp-inter-pac"}) {
      const std::string what = std::string(name) + " world " + std::to_string(world);
      const PlanSet fixed = planner_by_name(name)(samples, world, cost, memory, opt);
      PlannerOptions native_opt = opt;
      native_opt.native_iterations = true;
      const PlanSet native = planner_by_name(name)(samples, world, cost, memory, native_opt);
      expect_valid(native, samples, world, cost, memory, what);
      EXPECT_EQ(native.skipped_ids, fixed.skipped_ids) << what;
      EXPECT_GT(native.steps.size(), fixed.steps.size()) << what;
      if (std::string(name) != "dcp-intra") continue;
      size_t most_fixed = 0;
      for (const auto& step : fixed.steps) {
        for (const auto& g : step.groups) most_fixed = std::max(most_fixed, g.micro_batches.size());
      }
      EXPECT_GT(most_fixed, 1u) << what << ": the steps need rounds, else this checks nothing";
      for (const auto& step : native.steps) {
        for (const auto& g : step.groups) EXPECT_LE(g.micro_batches.size(), 1u) << what;
      }
    }
  }
}

// One bucket of 5 samples whose bs is 2 on one rank, two ranks: the fill gives each rank 2 samples (left 1),
// the retarget changes nothing (one bucket), the top-up target is the full bs; round 2 gives the last sample
// to the first group (least loaded first, ties in layout order) and the second finds the bucket empty.
TEST(ReferencePlanners, IntraHandComputedStep) {
  const CostModel cost(kShape, kH200);
  const MemoryModel memory(kShape, kH200);
  int64_t length = 0;
  for (int64_t len = 10'000; len < 210'000 && length == 0; len += 500) {
    const auto samples = samples_from_lengths({len}, "x");
    const ProfileTable t = profile_buckets(samples, 2, cost, memory, false);
    if (t.buckets.begin()->second.chosen.sp_size == 1 && t.buckets.begin()->second.chosen.bs == 2) length = len;
  }
  ASSERT_GT(length, 0) << "no length with bs 2 on one rank";
  const auto samples = samples_from_lengths(std::vector<int64_t>(5, length), "x");
  PlannerOptions opt;
  opt.samples_per_step = 5;
  const PlanSet set = plan_dcp_intra(samples, 2, cost, memory, opt);
  ASSERT_EQ(set.steps.size(), 1u);
  expect_valid(set, samples, 2, cost, memory, "intra hand");
  const auto& groups = set.steps[0].groups;
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].sp_size, 1);
  EXPECT_EQ(groups[1].sp_size, 1);
  EXPECT_EQ(mb_sizes(groups[0]), (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(mb_sizes(groups[1]), (std::vector<int64_t>{2}));
  const int64_t r = *memory.min_recompute_layers(length, 1);
  for (const auto& g : groups) {
    for (const auto& mb : g.micro_batches) EXPECT_EQ(mb.recompute_layers, r);
  }
}

// A long bucket that needs 2 ranks (bs 1) and a short one (bs >= 3) on 3 ranks, 2 long and 3 short samples.
// Fill: the first group takes the largest class (2 ranks, one long sample), the last rank the short bucket
// (all 3). Solver: t_long > t_short; caps 2 (one long sample left) and 1 (short bucket empty). Target t_long
// costs t_long - t_short, target t_short costs 1.2 (t_long - t_short), so g = (1, 1); min_gas 2 doubles it
// to (2, 1) within the caps: the long group runs both long samples, the short group one micro-batch.
TEST(ReferencePlanners, InterAndPacHandComputedStep) {
  const CostModel cost(kShape, kH200);
  const MemoryModel memory(kShape, kH200);
  const int64_t long_len = 300'000, short_len = 1000;
  ASSERT_FALSE(memory.min_recompute_layers(long_len, 1).has_value());
  ASSERT_GT(*memory.min_recompute_layers(long_len, 2), 0);
  const auto samples = samples_from_lengths({long_len, short_len, long_len, short_len, short_len}, "x");
  PlannerOptions opt;
  opt.samples_per_step = 5;
  for (bool pac : {false, true}) {
    const PlanSet set = (pac ? plan_dcp_inter_pac : plan_dcp_inter)(samples, 3, cost, memory, opt);
    const std::string what = pac ? "pac" : "inter";
    ASSERT_EQ(set.steps.size(), 1u);
    expect_valid(set, samples, 3, cost, memory, what);
    const auto& groups = set.steps[0].groups;
    ASSERT_EQ(groups.size(), 2u) << what;
    EXPECT_EQ(groups[0].sp_size, 2) << what;
    EXPECT_EQ(groups[1].sp_size, 1) << what;
    EXPECT_EQ(mb_sizes(groups[0]), (std::vector<int64_t>{1, 1})) << what;
    EXPECT_EQ(mb_sizes(groups[1]), (std::vector<int64_t>{3})) << what;
    const int64_t r_long = groups[0].micro_batches[0].recompute_layers;
    const int64_t r_short = groups[1].micro_batches[0].recompute_layers;
    EXPECT_GE(r_long, *memory.min_recompute_layers(long_len, 2)) << what;
    if (pac) {
      EXPECT_EQ(r_short, 0) << "PAC: a short bucket recomputes nothing";
      EXPECT_EQ(r_long, best_pac_setting(long_len, {1, 2}, cost, memory).recompute_layers);
    } else {
      EXPECT_EQ(r_short, r_long) << "no PAC: one recompute count for the epoch";
      EXPECT_EQ(r_long, *memory.min_recompute_layers(long_len, 2));
    }
  }
}

TEST(ReferencePlanners, RegisteredInTableOrder) {
  EXPECT_EQ(planner_names(),
            (std::vector<std::string>{"bucket", "packed", "dcp-intra", "dcp-inter", "dcp-inter-pac", "dcp-opt"}));
  try {
    planner_by_name("dcp");
    FAIL() << "no error for an unknown planner";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("dcp-inter-pac"), std::string::npos) << e.what();
  }
}

TEST(PlannerCommon, QuarterOctaveBucketsAndLeftoverGroups) {
  EXPECT_EQ(length_bucket(1), 0);
  EXPECT_EQ(length_bucket(16), 16);  // 2^(16/4) exactly: its own upper edge
  EXPECT_EQ(length_bucket(17), 17);  // 2^(17/4) = 19.03
  EXPECT_EQ(length_bucket(19), 17);
  EXPECT_EQ(length_bucket(20), 18);
  EXPECT_THROW(length_bucket(0), std::invalid_argument);
  EXPECT_EQ(power_of_two_sizes(12, kShape), (std::vector<int64_t>{1, 2, 4, 8}));
  EXPECT_EQ(leftover_groups(13, 2, {1, 2, 4, 8}), (std::vector<int64_t>{8, 2, 1}));
  StepRng a(1, 0, 0, 1), b(1, 0, 1, 1);
  EXPECT_NE(a.next(), b.next());
}
