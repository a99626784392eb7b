#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "dcp/plan.h"
#include "unit/error_of.h"

using namespace dcp;

namespace {

std::vector<Sample> random_samples(int n, int max_len, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Sample> s;
  for (int i = 0; i < n; ++i) s.push_back(Sample{i, 1 + static_cast<int64_t>(rng() % max_len), "s"});
  return s;
}

std::vector<int64_t> all_ids(const std::vector<Sample>& s) {
  std::vector<int64_t> ids;
  for (const auto& x : s) ids.push_back(x.id);
  return ids;
}

}  // namespace

TEST(DataParallelPlanner, EverySampleExactlyOnceAndPlansValid) {
  for (int64_t world : {1, 2, 3, 5}) {
    auto samples = random_samples(200, 500, static_cast<uint32_t>(world));
    auto order = epoch_order(all_ids(samples), 7, 0);
    auto plans = plan_data_parallel(samples, order, 0, {world, 2000, 600, 1});
    std::vector<int> seen(samples.size(), 0);
    for (const auto& p : plans) {
      p.validate(world, samples, 4);
      int64_t tokens = 0;
      for (const auto& g : p.groups) {
        for (const auto& mb : g.micro_batches) {
          EXPECT_LE(mb.num_tokens, 600);
          EXPECT_EQ(mb.recompute_layers, 1);
          for (auto id : mb.sample_ids) ++seen[static_cast<size_t>(id)];
          tokens += mb.num_tokens;
        }
      }
      EXPECT_LE(tokens, 2000);
    }
    for (int c : seen) EXPECT_EQ(c, 1);
  }
}

TEST(DataParallelPlanner, BalancesTokensAcrossRanks) {
  auto samples = random_samples(64, 100, 3);
  auto plans = plan_data_parallel(samples, all_ids(samples), 0, {4, 1 << 20, 1 << 20, 0});
  ASSERT_EQ(plans.size(), 1u);
  std::vector<int64_t> load;
  for (const auto& g : plans[0].groups) {
    int64_t t = 0;
    for (const auto& mb : g.micro_batches) t += mb.num_tokens;
    load.push_back(t);
  }
  auto [mn, mx] = std::minmax_element(load.begin(), load.end());
  EXPECT_LE(*mx - *mn, 100);  // LPT: within one sample of each other
}

TEST(DataParallelPlanner, RejectsSampleLongerThanMicroBatch) {
  std::vector<Sample> samples{{0, 10, "a"}, {1, 700, "b"}};
  EXPECT_THROW(plan_data_parallel(samples, {0, 1}, 0, {2, 1000, 600, 0}), std::invalid_argument);
}

TEST(EpochOrder, IsAPermutationAndDependsOnSeedAndEpoch) {
  std::vector<int64_t> ids(100);
  for (int i = 0; i < 100; ++i) ids[static_cast<size_t>(i)] = i;
  auto a = epoch_order(ids, 1, 0);
  auto sorted = a;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(sorted, ids);
  EXPECT_EQ(a, epoch_order(ids, 1, 0));
  EXPECT_NE(a, epoch_order(ids, 1, 1));
  EXPECT_NE(a, epoch_order(ids, 2, 0));
}

TEST(StepPlan, JsonRoundTripHashAndValidation) {
  auto samples = random_samples(20, 50, 9);
  auto plans = plan_data_parallel(samples, all_ids(samples), 3, {2, 300, 120, 2});
  for (const auto& p : plans) {
    StepPlan q = StepPlan::from_json(p.to_json());
    EXPECT_EQ(q.to_json(), p.to_json());
    EXPECT_EQ(q.hash(), p.hash());
  }
  StepPlan bad = plans[0];
  bad.global_num_tokens += 1;
  EXPECT_NE(bad.hash(), plans[0].hash());
  EXPECT_THROW(bad.validate(2, samples, 4), std::invalid_argument);
  StepPlan overlap = plans[0];
  overlap.groups[1].first_rank = 0;
  EXPECT_THROW(overlap.validate(2, samples, 4), std::invalid_argument);
  StepPlan unaligned = plans[0];
  unaligned.groups = {GroupPlan{1, 2, {}}};
  EXPECT_THROW(unaligned.validate(3, samples, 4), std::invalid_argument);
  EXPECT_THROW(StepPlan::from_json("{\"epoch\": 0}"), std::invalid_argument);
  EXPECT_THROW(StepPlan::from_json("not json"), std::invalid_argument);
}

// A sample trains at most once per step: a repeat in one micro-batch or in two groups is refused, naming both places.
TEST(StepPlan, ValidationRefusesASampleUsedTwice) {
  const std::vector<Sample> samples = {{0, 10, "a"}, {1, 20, "b"}, {2, 30, "c"}};
  auto plan = [](std::vector<int64_t> first, std::vector<int64_t> second, const std::vector<Sample>& s) {
    auto mb = [&](const std::vector<int64_t>& ids) {
      MicroBatch m{ids, 0, 0};
      for (int64_t id : ids) m.num_tokens += s[static_cast<size_t>(id)].length;
      return m;
    };
    StepPlan p;
    p.groups = {GroupPlan{0, 1, {mb(first)}}, GroupPlan{1, 1, {mb({2})}}};
    if (!second.empty()) p.groups[1].micro_batches.push_back(mb(second));
    for (const auto& g : p.groups) {
      for (const auto& m : g.micro_batches) p.global_num_tokens += m.num_tokens;
    }
    return p;
  };
  EXPECT_NO_THROW(plan({0}, {1}, samples).validate(2, samples, 4));
  EXPECT_EQ(test::error_of([&] { plan({0, 1, 0}, {}, samples).validate(2, samples, 4); }),
            "step plan (epoch 0, index 0): sample id 0 is used twice: in micro_batch 0 of the group at rank 0 and in "
            "micro_batch 0 of the group at rank 0");
  EXPECT_EQ(test::error_of([&] { plan({0, 1}, {0}, samples).validate(2, samples, 4); }),
            "step plan (epoch 0, index 0): sample id 0 is used twice: in micro_batch 0 of the group at rank 0 and in "
            "micro_batch 1 of the group at rank 1");
}

// sp_mode and ulysses_size: omitted for Ulysses (old plans keep their JSON and hash), round-tripped otherwise,
// and validated against the mode.
TEST(StepPlan, SpModesRoundTripAndAreValidated) {
  const std::vector<Sample> samples = {{0, 10, "a"}, {1, 20, "b"}};
  StepPlan p;
  p.groups = {GroupPlan{0, 4, {MicroBatch{{0, 1}, 30, 0}}}};
  p.global_num_tokens = 30;
  const std::string ulysses_json = p.to_json();
  EXPECT_EQ(ulysses_json.find("sp_mode"), std::string::npos);
  for (auto [mode, u] : std::vector<std::pair<SpMode, int64_t>>{{SpMode::kRing, 0}, {SpMode::kUlyssesRing, 2}}) {
    StepPlan q = p;
    q.groups[0].sp_mode = mode;
    q.groups[0].ulysses_size = u;
    EXPECT_NO_THROW(q.validate(4, samples, 2));
    const StepPlan back = StepPlan::from_json(q.to_json());
    EXPECT_EQ(back.groups[0].sp_mode, mode);
    EXPECT_EQ(back.groups[0].ulysses_size, u);
    EXPECT_EQ(back.to_json(), q.to_json());
    EXPECT_NE(q.hash(), p.hash());
    EXPECT_EQ(q.groups[0].layout().ring_size(), mode == SpMode::kRing ? 4 : 2);
  }
  StepPlan bad = p;
  bad.groups[0].sp_mode = SpMode::kUlyssesRing;  // ulysses_size 0
  EXPECT_NE(test::error_of([&] { bad.validate(4, samples, 2); }).find("needs ulysses_size strictly between 1 and sp_size"),
            std::string::npos);
  bad.groups[0].ulysses_size = 3;  // does not divide 4
  EXPECT_THROW(bad.validate(4, samples, 2), std::invalid_argument);
  bad.groups[0].sp_mode = SpMode::kRing;  // a size that belongs to no ring
  EXPECT_NE(test::error_of([&] { bad.validate(4, samples, 2); }).find("ulysses_size 3 is set but sp_mode is ring"),
            std::string::npos);
  std::string unknown = ulysses_json;
  unknown.replace(unknown.find("\"sp_size\""), 0, "\"sp_mode\":\"star\",");
  EXPECT_NE(test::error_of([&] { StepPlan::from_json(unknown); }).find("unknown sp_mode 'star'"), std::string::npos);
  EXPECT_EQ(sp_mode_from_name("ulysses-ring"), SpMode::kUlyssesRing);
  EXPECT_EQ(ulysses_ring_size(8, 0, 4), 4);   // the largest divisor of both below 8
  EXPECT_EQ(ulysses_ring_size(8, 0, 2), 2);
  EXPECT_EQ(ulysses_ring_size(4, 0, 3), 0);   // nothing divides 3 and 4 strictly between 1 and 4
  EXPECT_EQ(ulysses_ring_size(8, 4, 2), 0);   // 4 does not divide the 2 heads
}

// Integer fields must be JSON integers (nlohmann would turn 2.5 into 2 and 1e300 into an undefined value).
TEST(StepPlan, IntegerFieldsAreJsonIntegers) {
  const std::string good =
      R"({"epoch":0,"index":0,"global_num_tokens":30,"groups":[{"first_rank":0,"sp_size":4,"sp_mode":"ulysses-ring",)"
      R"("ulysses_size":2,"micro_batches":[{"sample_ids":[0,1],"num_tokens":30,"recompute_layers":1}]}]})";
  EXPECT_EQ(StepPlan::from_json(good).groups[0].ulysses_size, 2);
  for (const auto& [from, to] : std::vector<std::pair<std::string, std::string>>{
           {"\"ulysses_size\":2", "\"ulysses_size\":2.5"}, {"\"sp_size\":4", "\"sp_size\":4.0"},
           {"\"ulysses_size\":2", "\"ulysses_size\":1e300"}, {"\"ulysses_size\":2", "\"ulysses_size\":18446744073709551615"},
           {"\"recompute_layers\":1", "\"recompute_layers\":0.5"}, {"[0,1]", "[0,1.5]"}}) {
    std::string text = good;
    text.replace(text.find(from), from.size(), to);
    const std::string message = test::error_of([&] { StepPlan::from_json(text); });
    EXPECT_NE(message.find("is not a 64-bit JSON integer"), std::string::npos) << to << ": " << message;
  }
}

// ---------------------------------------------------------------------------------------------- rounds

namespace {

GroupPlan group(int64_t first, int64_t sp, std::vector<MicroBatch> mbs, int64_t round) {
  GroupPlan g{first, sp, std::move(mbs)};
  g.round = round;
  return g;
}

// Samples of 10, 20, 30, 40 tokens; round 0: one group of 2 ranks, round 1: two single ranks.
StepPlan two_round_plan() {
  StepPlan p;
  p.groups = {group(0, 2, {MicroBatch{{3}, 40, 1}}, 0), group(0, 1, {MicroBatch{{0, 1}, 30, 0}}, 1),
              group(1, 1, {MicroBatch{{2}, 30, 2}}, 1)};
  p.global_num_tokens = 100;
  return p;
}

const std::vector<Sample> kFour = {{0, 10, "a"}, {1, 20, "b"}, {2, 30, "c"}, {3, 40, "d"}};

}  // namespace

// A one-round plan is written as before rounds existed: top-level "groups", the same text and the same hash
// (pinned here: FNV-1a of this exact text, >> 2).
TEST(StepPlanRounds, OneRoundPlansKeepTheirJsonAndHash) {
  StepPlan p;
  p.groups = {GroupPlan{0, 4, {MicroBatch{{0, 1}, 30, 0}}}};
  p.global_num_tokens = 30;
  const std::string text =
      R"({"epoch":0,"global_num_tokens":30,"groups":[{"first_rank":0,"micro_batches":[{"num_tokens":30,)"
      R"("recompute_layers":0,"sample_ids":[0,1]}],"sp_size":4}],"index":0})";
  EXPECT_EQ(p.to_json(), text);
  EXPECT_EQ(p.hash(), int64_t{4565619523495906128});
  EXPECT_EQ(p.num_rounds(), 1);
  // The same plan written as one round of "rounds" reads back as the one-round plan.
  const std::string as_rounds =
      R"({"epoch":0,"global_num_tokens":30,"rounds":[{"groups":[{"first_rank":0,"micro_batches":[{"num_tokens":30,)"
      R"("recompute_layers":0,"sample_ids":[0,1]}],"sp_size":4}]}],"index":0})";
  EXPECT_EQ(StepPlan::from_json(as_rounds).to_json(), text);
}

TEST(StepPlanRounds, RoundsRoundTripAndEachRoundPartitionsTheRanks) {
  const StepPlan p = two_round_plan();
  EXPECT_EQ(p.num_rounds(), 2);
  EXPECT_NO_THROW(p.validate(2, kFour, 2));
  const std::string text = p.to_json();
  EXPECT_NE(text.find("\"rounds\""), std::string::npos);
  EXPECT_EQ(text.find("\"round\""), std::string::npos);  // a round is where its group is listed
  const StepPlan back = StepPlan::from_json(text);
  EXPECT_EQ(back.to_json(), text);
  EXPECT_EQ(back.hash(), p.hash());
  ASSERT_EQ(back.groups.size(), 3u);
  EXPECT_EQ(back.groups[0].round, 0);
  EXPECT_EQ(back.groups[2].round, 1);
  EXPECT_EQ(back.group_of(1, 0).sp_size, 2);
  EXPECT_EQ(back.group_of(1, 1).first_rank, 1);
  EXPECT_NE(test::error_of([&] { back.group_of(1, 2); }).find("no group for rank 1 in round 2"), std::string::npos);
  EXPECT_EQ(back.sample_ids(), (std::vector<int64_t>{3, 0, 1, 2}));
  // Moving a group to another round changes the plan, its JSON and its hash.
  StepPlan merged = p;
  for (auto& g : merged.groups) g.round = 0;
  merged.groups = {merged.groups[1], merged.groups[2]};
  merged.groups[0].micro_batches.push_back(MicroBatch{{3}, 40, 1});
  EXPECT_NO_THROW(merged.validate(2, kFour, 2));
  EXPECT_NE(merged.hash(), p.hash());
}

// Validation names the round and the group; a sample used in two rounds names both places.
TEST(StepPlanRounds, ValidationNamesTheRoundAndTheGroup) {
  auto message = [](const StepPlan& p) { return test::error_of([&] { p.validate(2, kFour, 2); }); };
  StepPlan hole = two_round_plan();
  hole.groups.pop_back();
  hole.global_num_tokens = 70;
  EXPECT_EQ(message(hole), "step plan (epoch 0, index 0): round 1: rank 1 is in no group");
  StepPlan twice = two_round_plan();
  twice.groups[2].micro_batches[0] = MicroBatch{{3}, 40, 0};
  twice.global_num_tokens = 110;
  EXPECT_EQ(message(twice),
            "step plan (epoch 0, index 0): sample id 3 is used twice: in micro_batch 0 of the group at rank 0 in "
            "round 0 and in micro_batch 0 of the group at rank 1 in round 1");
  StepPlan overlap = two_round_plan();
  overlap.groups[2].first_rank = 0;
  EXPECT_EQ(message(overlap), "step plan (epoch 0, index 0): round 1: rank 0 is in more than one group");
  StepPlan unaligned = two_round_plan();
  unaligned.groups[0] = group(1, 2, {MicroBatch{{3}, 40, 1}}, 0);
  EXPECT_EQ(message(unaligned), "step plan (epoch 0, index 0): round 0: group [1, 3) is outside world_size 2");
  StepPlan deep = two_round_plan();
  deep.groups[1].micro_batches[0].recompute_layers = 5;
  EXPECT_EQ(message(deep), "step plan (epoch 0, index 0): round 1: recompute_layers 5 outside [0, 2]");
  StepPlan order = two_round_plan();
  std::swap(order.groups[0], order.groups[2]);
  EXPECT_NE(message(order).find("is listed after a group of round 1 (groups are listed by round)"), std::string::npos);
  StepPlan gap = two_round_plan();
  for (auto& g : gap.groups) g.round *= 2;  // rounds 0 and 2
  EXPECT_EQ(message(gap), "step plan (epoch 0, index 0): round 1 has no group (the groups of a round partition the ranks)");
  StepPlan negative = two_round_plan();
  negative.groups[0].round = -1;
  EXPECT_NE(message(negative).find("has round -1"), std::string::npos);
}

TEST(StepPlanRounds, MalformedRoundsAreRefusedNamingThem) {
  const std::string head = R"({"epoch":0,"index":0,"global_num_tokens":30,)";
  const std::string g = R"({"first_rank":0,"sp_size":1,"micro_batches":[{"sample_ids":[0,1],"num_tokens":30}]})";
  auto message = [](const std::string& text) { return test::error_of([&] { StepPlan::from_json(text); }); };
  EXPECT_NE(message(head + R"("groups":[)" + g + R"(],"rounds":[{"groups":[)" + g + "]}]}").find("has both"),
            std::string::npos);
  EXPECT_NE(message(head + R"("rounds":[]})").find("field 'rounds' in step (epoch 0, index 0) is empty"),
            std::string::npos);
  EXPECT_NE(message(head + R"("rounds":[{"groups":[)" + g + R"(]},{"groups":[]}]})")
                .find("round 1 has no group"),
            std::string::npos);
  EXPECT_NE(message(head + R"("rounds":[{"groups":[)" + g + R"(]},{}]})")
                .find("missing field 'groups' in step (epoch 0, index 0) round 1"),
            std::string::npos);
  EXPECT_NE(message(head + R"("rounds":{"groups":[]}})").find("is not a list"), std::string::npos);
  EXPECT_NE(message(head + R"("rounds":[{"groups":[{"first_rank":0,"sp_size":1.5,"micro_batches":[]}]}]})")
                .find("field 'sp_size' in step (epoch 0, index 0) round 0 group"),
            std::string::npos);
  EXPECT_NE(message(R"({"epoch":0,"index":0,"global_num_tokens":30})").find("missing field 'groups'"),
            std::string::npos);
}
