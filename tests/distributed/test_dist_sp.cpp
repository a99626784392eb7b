// Run under `dcp launch --nproc 4 -- test_dist_sp`: sequence parallelism and heterogeneous plans.
#include <gtest/gtest.h>

#include "dcp/sequence_parallel.h"
#include "distributed/fixtures.h"

using namespace dcp;
using namespace dcp::test;

namespace {

MicroBatch micro_batch(const Corpus& corpus, std::vector<int64_t> ids, int64_t recompute_layers) {
  MicroBatch mb{std::move(ids), 0, recompute_layers};
  for (int64_t id : mb.sample_ids) mb.num_tokens += corpus.samples()[static_cast<size_t>(id)].length;
  return mb;
}

StepPlan make_plan(std::vector<GroupPlan> groups) {
  StepPlan p;
  p.groups = std::move(groups);
  for (const auto& g : p.groups)
    for (const auto& mb : g.micro_batches) p.global_num_tokens += mb.num_tokens;
  return p;
}

}  // namespace

namespace {

void expect_sp_logits_equal_single_rank(const Config& cfg) {
  ASSERT_EQ(groups().world().size(), 4);
  Corpus corpus = tiny_corpus(cfg);
  const std::vector<int64_t> ids = {1, 5, 2, 9};  // lengths 20, 11, 33, 37: a stream of 101 tokens
  Transformer model = fresh_model(cfg);
  torch::NoGradGuard no_grad;
  torch::Tensor full = model->forward(make_batch(corpus, ids));  // [T, vocab]
  const int64_t total = full.size(0);
  for (int64_t sp : {2, 4}) {
    const Communicator& group = groups().group(sp);
    PackedBatch shard = make_shard(corpus, ids, group.rank(), sp);
    shard.attention = std::make_shared<SequenceParallelAttention>(group);
    torch::Tensor local = model->forward(shard);
    const int64_t begin = group.rank() * shard.num_tokens();
    const int64_t real = std::max<int64_t>(0, std::min(total - begin, shard.num_tokens()));
    ASSERT_GT(real, 0);
    EXPECT_TRUE(torch::allclose(local.slice(0, 0, real), full.slice(0, begin, begin + real), 1e-5, 1e-5))
        << "sp " << sp << " rank " << group.rank();
    EXPECT_TRUE((shard.targets.slice(0, real) == -100).all().item<bool>());  // padding never reaches the loss
  }
}

std::string joined(const std::vector<std::string>& parts) {
  std::string s;
  for (const auto& p : parts) s += (s.empty() ? "" : " ") + p;
  return s;
}

// Flexformer keeps per-layer, per-head parameters: under SP each rank must attend with exactly its heads' ones.
const std::vector<std::vector<std::string>> kFlexformerVariants{
    {"--attention.backend=flexformer", "--attention.num_features=8", "--attention.chunk_size=8"},
    {"--attention.backend=flexformer", "--attention.feature_map=nonstationary", "--attention.normalizer=none",
     "--attention.input_norm=rms", "--attention.num_features=6", "--attention.chunk_size=5"},
    {"--attention.backend=flexformer", "--attention.feature_map=elu", "--attention.mode=recurrent"},
};

}  // namespace

TEST(SequenceParallel, ForwardLogitsEqualSingleRank) { expect_sp_logits_equal_single_rank(tiny_config()); }

TEST(SequenceParallel, Bf16AllToAllMovesEveryBitPattern) {
  // Every one of the 65536 bf16 bit patterns (NaN payloads, infinities, subnormals, -0 included); member r sends
  // chunk j to member j, so member r receives chunk r of every member: its own chunk, 4 times.
  const Communicator& group = groups().group(4);
  const auto bits = torch::arange(-32768, 32768, torch::kInt32).to(torch::kInt16);
  torch::Tensor out = group.all_to_all(bits.view(torch::kBFloat16));
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  const auto mine = bits.slice(0, group.rank() * 16384, (group.rank() + 1) * 16384);
  EXPECT_TRUE(torch::equal(out.view(torch::kInt16), mine.repeat({4})));
}

TEST(SequenceParallel, FlexformerForwardLogitsEqualSingleRank) {
  for (const auto& variant : kFlexformerVariants) {
    SCOPED_TRACE(joined(variant));
    expect_sp_logits_equal_single_rank(tiny_config(variant));
  }
}

TEST(SequenceParallel, MixedPlanGradientEqualsSingleProcess) {
  Config cfg = tiny_config();
  Corpus corpus = tiny_corpus(cfg);
  // One group of 2 ranks with two micro-batches, two groups of 1 rank with one and three micro-batches,
  // different recompute layers, and token counts that are odd (not divisible by 2).
  StepPlan plan = make_plan({
      GroupPlan{0, 2, {micro_batch(corpus, {0, 3}, 1), micro_batch(corpus, {6}, 3)}},
      GroupPlan{2, 1, {micro_batch(corpus, {2, 1}, 0)}},
      GroupPlan{3, 1, {micro_batch(corpus, {4}, 2), micro_batch(corpus, {5, 8}, 0), micro_batch(corpus, {7}, 1)}},
  });
  plan.validate(4, corpus.samples(), cfg.model.n_layers);
  ASSERT_EQ(plan.groups[0].micro_batches[0].num_tokens % 2, 1);
  expect_step_matches_reference(cfg, corpus, plan);
}

TEST(SequenceParallel, OneGroupOfFourGradientEqualsSingleProcess) {
  Config cfg = tiny_config();
  Corpus corpus = tiny_corpus(cfg);
  StepPlan plan = make_plan({GroupPlan{0, 4, {micro_batch(corpus, {1, 2, 3}, 2), micro_batch(corpus, {10}, 0)}}});
  expect_step_matches_reference(cfg, corpus, plan);
}

TEST(SequenceParallel, FlexformerMixedPlanGradientEqualsSingleProcess) {
  for (const auto& variant : kFlexformerVariants) {
    SCOPED_TRACE(joined(variant));
    Config cfg = tiny_config(variant);
    Corpus corpus = tiny_corpus(cfg);
    // SP 4, and SP 2 next to two single ranks, with recompute.
    const std::vector<StepPlan> plans{
        make_plan({GroupPlan{0, 4, {micro_batch(corpus, {1, 2, 3}, 2), micro_batch(corpus, {10}, 0)}}}),
        make_plan({
            GroupPlan{0, 2, {micro_batch(corpus, {0, 3}, 1), micro_batch(corpus, {6}, 3)}},
            GroupPlan{2, 1, {micro_batch(corpus, {2, 1}, 0)}},
            GroupPlan{3, 1, {micro_batch(corpus, {4}, 2), micro_batch(corpus, {5, 8}, 0)}},
        })};
    for (const StepPlan& plan : plans) {
      expect_step_matches_reference(cfg, corpus, plan);
      // Each attention parameter on its own scale: every head slice must get exactly its heads' gradient.
      Transformer model = fresh_model(cfg);
      compute_step_gradients(model, corpus, plan, groups());
      Transformer reference = fresh_model(cfg);
      reference_step_gradients(reference, corpus, plan);
      auto ref = reference->named_parameters();
      int checked = 0;
      for (const auto& p : model->named_parameters()) {
        if (p.key().find(".attention.") == std::string::npos) continue;
        const torch::Tensor& want = ref[p.key()].grad();
        const double scale = want.abs().max().item<double>();
        ASSERT_GT(scale, 0.0) << p.key();
        EXPECT_LT((p.value().grad() - want).abs().max().item<double>(), 1e-4 * scale) << p.key();
        ++checked;
      }
      EXPECT_GE(checked, cfg.model.n_layers);
    }
  }
}

TEST(SequenceParallel, HeadsNotDivisibleBySpSizeIsAClearError) {
  Config cfg = tiny_config({"--model.n_heads=2", "--model.d_model=32"});
  Corpus corpus = tiny_corpus(cfg);
  StepPlan plan = make_plan({GroupPlan{0, 4, {micro_batch(corpus, {1}, 0)}}});
  Transformer model = fresh_model(cfg);
  try {
    compute_step_gradients(model, corpus, plan, groups());
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("sp_size 4 does not divide the K/V heads 2"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------- ring modes

namespace {

GroupPlan ring_group(int64_t first, int64_t sp, std::vector<MicroBatch> mbs, SpMode mode, int64_t ulysses = 0) {
  GroupPlan g{first, sp, std::move(mbs)};
  g.sp_mode = mode;
  g.ulysses_size = ulysses;
  return g;
}

}  // namespace

TEST(RingAttention, ExchangeMovesEveryBf16BitPatternAlongTheRing) {
  // Shifts by 1 and by 2 of a ring of 4, two exchanges in flight at once (as the ring's backward has), bf16 bit
  // for bit (Gloo has no bf16: the bytes travel as fp16).
  const Communicator& group = groups().group(4);
  const int64_t me = group.rank();
  const auto bits = torch::arange(-32768, 32768, torch::kInt32).to(torch::kInt16);
  auto mine = (bits + static_cast<int16_t>(me)).view(torch::kBFloat16);
  auto by_one = group.exchange(mine, (me + 1) % 4, (me + 3) % 4);
  auto by_two = group.exchange(mine.to(torch::kFloat), (me + 2) % 4, (me + 2) % 4);
  const torch::Tensor one = by_one.wait(), two = by_two.wait();
  EXPECT_EQ(one.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::equal(one.view(torch::kInt16), bits + static_cast<int16_t>((me + 3) % 4)));
  const auto theirs = (bits + static_cast<int16_t>((me + 2) % 4)).view(torch::kBFloat16).to(torch::kFloat);
  EXPECT_TRUE(torch::equal(two.view(torch::kInt32), theirs.view(torch::kInt32)));  // bit for bit, NaNs included
  EXPECT_THROW(by_one.wait(), std::logic_error);
  EXPECT_THROW(group.exchange(mine, 4, 0), std::invalid_argument);
}

TEST(RingAttention, ForwardLogitsEqualSingleRankForEveryLayout) {
  Config cfg = tiny_config();
  Corpus corpus = tiny_corpus(cfg);
  const std::vector<int64_t> ids = {1, 5, 0, 2, 9};  // 20, 72, 7, 33, 124 tokens: 256 = no padding at 8 chunks
  Transformer model = fresh_model(cfg);
  torch::NoGradGuard no_grad;
  torch::Tensor full = model->forward(make_batch(corpus, ids));
  for (const SpLayout layout : {SpLayout{2, 1}, SpLayout{4, 1}, SpLayout{4, 2}}) {
    SCOPED_TRACE("sp " + std::to_string(layout.sp_size) + " ulysses " + std::to_string(layout.ulysses_size));
    const Communicator& group = groups().group(layout.sp_size);
    PackedBatch shard = make_shard(corpus, ids, group.rank(), layout);
    shard.attention = std::make_shared<RingAttention>(group, groups().group(layout.ulysses_size), layout);
    torch::Tensor local = model->forward(shard);
    std::vector<torch::Tensor> want;
    for (const auto& [b, e] : layout.shard(layout.padded_length(full.size(0)), group.rank())) {
      want.push_back(full.slice(0, std::min(b, full.size(0)), std::min(e, full.size(0))));
    }
    torch::Tensor expected = torch::cat(want);
    ASSERT_GT(expected.size(0), 0);
    EXPECT_TRUE(torch::allclose(local.slice(0, 0, expected.size(0)), expected, 1e-5, 1e-5));
  }
}

TEST(RingAttention, RingAndUlyssesRingGradientsEqualSingleProcess) {
  Config cfg = tiny_config();
  Corpus corpus = tiny_corpus(cfg);
  // Sample 0 (7 tokens) is shorter than the 8 zigzag chunks of a ring of 4; streams are packed and padded.
  const std::vector<StepPlan> plans{
      make_plan({ring_group(0, 4, {micro_batch(corpus, {1, 2, 3}, 2), micro_batch(corpus, {0}, 0)}, SpMode::kRing)}),
      make_plan({ring_group(0, 4, {micro_batch(corpus, {10, 0}, 1), micro_batch(corpus, {5, 6}, 3)},
                            SpMode::kUlyssesRing, 2)}),
      // Mixed modes in one step: a ring pair next to a Ulysses pair, then a ring pair next to two single ranks.
      make_plan({ring_group(0, 2, {micro_batch(corpus, {0, 3}, 1), micro_batch(corpus, {6}, 3)}, SpMode::kRing),
                 ring_group(2, 2, {micro_batch(corpus, {2, 1}, 0)}, SpMode::kUlysses)}),
      make_plan({GroupPlan{0, 1, {micro_batch(corpus, {4}, 2)}}, GroupPlan{1, 1, {micro_batch(corpus, {8}, 0)}},
                 ring_group(2, 2, {micro_batch(corpus, {9, 0}, 2), micro_batch(corpus, {7}, 0)}, SpMode::kRing)}),
  };
  for (size_t i = 0; i < plans.size(); ++i) {
    SCOPED_TRACE("plan " + std::to_string(i));
    plans[i].validate(4, corpus.samples(), cfg.model.n_layers);
    expect_step_matches_reference(cfg, corpus, plans[i]);
  }
}

TEST(RingAttention, RingGoesBeyondTheHeadCount) {
  // Two heads: Ulysses stops at sp 2, a ring of 4 does not, and ulysses-ring 2 x 2 fits.
  Config cfg = tiny_config({"--model.n_heads=2"});
  Corpus corpus = tiny_corpus(cfg);
  for (const StepPlan& plan :
       {make_plan({ring_group(0, 4, {micro_batch(corpus, {11, 0}, 1)}, SpMode::kRing)}),
        make_plan({ring_group(0, 4, {micro_batch(corpus, {3, 4}, 0)}, SpMode::kUlyssesRing, 2)})}) {
    expect_step_matches_reference(cfg, corpus, plan);
  }
}

TEST(RingAttention, Bf16RingErrsNoMoreThanOneProcessInBf16) {
  // bf16 rounds each block's probabilities and partial outputs (the merge is fp32), so the ring's bf16 gradient
  // differs from the fp32 one; it must not differ more than the one-process bf16 gradient does (x 1.5 + 1e-3:
  // the two round at different places).
  Config cfg = tiny_config();
  Corpus corpus = tiny_corpus(cfg);
  StepPlan plan = make_plan({ring_group(0, 4, {micro_batch(corpus, {1, 2, 3}, 1)}, SpMode::kRing)});
  auto run = [&](bool ring, Precision precision) {
    Transformer model = fresh_model(cfg);
    model->precision = precision;
    if (ring) {
      compute_step_gradients(model, corpus, plan, groups());
    } else {
      reference_step_gradients(model, corpus, plan);
    }
    return model;
  };
  Transformer fp32 = run(false, Precision::kFp32), one = run(false, Precision::kBf16), ring = run(true, Precision::kBf16);
  const double one_err = compare_gradients(one, fp32).max_rel_err, ring_err = compare_gradients(ring, fp32).max_rel_err;
  EXPECT_GT(one_err, 0.0);
  EXPECT_LT(ring_err, 1.5 * one_err + 1e-3) << "one-process bf16 " << one_err;
}

TEST(RingAttention, RingModesNeedTheSoftmaxBackendAndSayWhy) {
  Config cfg = tiny_config(kFlexformerVariants[0]);
  Corpus corpus = tiny_corpus(cfg);
  StepPlan plan = make_plan({ring_group(0, 4, {micro_batch(corpus, {1}, 0)}, SpMode::kRing)});
  Transformer model = fresh_model(cfg);
  try {
    compute_step_gradients(model, corpus, plan, groups());
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("sp_mode ring, which needs attention.backend softmax"), std::string::npos)
        << e.what();
  }
  StepPlan odd = make_plan({ring_group(0, 4, {micro_batch(corpus, {1}, 0)}, SpMode::kUlyssesRing, 4)});
  EXPECT_THROW(odd.validate(4, corpus.samples(), 3), std::invalid_argument);  // ulysses_size must be < sp_size
}

// ---------------------------------------------------------------------------------------------- grouped-query attention

TEST(GroupedQueryAttention, SpForwardAndGradientsEqualSingleProcess) {
  // 4 query heads over 2 K/V heads: Ulysses at sp 2 carries each member's K/V heads at their own width, a ring of
  // 4 passes K/V blocks of 2 heads, ulysses-ring 2 x 2 combines both; all equal one process (which expands K/V).
  Config cfg = tiny_config({"--model.n_kv_heads=2"});
  Corpus corpus = tiny_corpus(cfg);
  const std::vector<int64_t> ids = {1, 5, 2, 9};
  Transformer model = fresh_model(cfg);
  {
    torch::NoGradGuard no_grad;
    torch::Tensor full = model->forward(make_batch(corpus, ids));
    const Communicator& group = groups().group(2);
    PackedBatch shard = make_shard(corpus, ids, group.rank(), 2);
    shard.attention = std::make_shared<SequenceParallelAttention>(group);
    torch::Tensor local = model->forward(shard);
    const int64_t begin = group.rank() * shard.num_tokens();
    const int64_t real = std::max<int64_t>(0, std::min(full.size(0) - begin, shard.num_tokens()));
    EXPECT_TRUE(torch::allclose(local.slice(0, 0, real), full.slice(0, begin, begin + real), 1e-5, 1e-5));
  }
  const std::vector<StepPlan> plans{
      make_plan({GroupPlan{0, 2, {micro_batch(corpus, {0, 3}, 1)}}, GroupPlan{2, 2, {micro_batch(corpus, {2, 1}, 0)}}}),
      make_plan({ring_group(0, 4, {micro_batch(corpus, {1, 2, 3}, 2), micro_batch(corpus, {0}, 0)}, SpMode::kRing)}),
      make_plan({ring_group(0, 4, {micro_batch(corpus, {10, 0}, 1)}, SpMode::kUlyssesRing, 2)}),
  };
  for (size_t i = 0; i < plans.size(); ++i) {
    SCOPED_TRACE("plan " + std::to_string(i));
    plans[i].validate(4, corpus.samples(), cfg.model.n_layers);
    expect_step_matches_reference(cfg, corpus, plans[i]);
  }
}

TEST(GroupedQueryAttention, UlyssesBeyondTheKvHeadsIsAClearError) {
  // sp 4 divides the 4 query heads but not the 2 K/V heads: the plan check names them before any work.
  Config cfg = tiny_config({"--model.n_kv_heads=2"});
  Corpus corpus = tiny_corpus(cfg);
  StepPlan plan = make_plan({GroupPlan{0, 4, {micro_batch(corpus, {1}, 0)}}});
  Transformer model = fresh_model(cfg);
  try {
    compute_step_gradients(model, corpus, plan, groups());
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("sp_size 4 does not divide the K/V heads 2"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------------------------- rounds

namespace {

// `g` in round `round` of its step.
GroupPlan in_round(GroupPlan g, int64_t round) {
  g.round = round;
  return g;
}

}  // namespace

// A step of several rounds (the ranks repartitioned within the step) computes the single-process gradient: sp 1,
// Ulysses, ring and ulysses-ring groups in different rounds, a rank idle in one round, recompute varying.
TEST(Rounds, PlansOfTwoToFourRoundsGradientEqualsSingleProcess) {
  Config cfg = tiny_config();
  Corpus corpus = tiny_corpus(cfg);
  const std::vector<StepPlan> plans{
      // Long samples on all four ranks first, then the short ones on their own ranks.
      make_plan({in_round(GroupPlan{0, 4, {micro_batch(corpus, {11, 10}, 2)}}, 0),
                 in_round(GroupPlan{0, 1, {micro_batch(corpus, {0, 1}, 0)}}, 1),
                 in_round(GroupPlan{1, 1, {micro_batch(corpus, {2}, 3)}}, 1),
                 in_round(GroupPlan{2, 1, {micro_batch(corpus, {3}, 0), micro_batch(corpus, {4}, 1)}}, 1),
                 in_round(GroupPlan{3, 1, {}}, 1)}),
      // Three rounds: a ring of 4, then a Ulysses pair beside two single ranks, then ulysses-ring 2 x 2.
      make_plan({in_round(ring_group(0, 4, {micro_batch(corpus, {9}, 1)}, SpMode::kRing), 0),
                 in_round(GroupPlan{0, 2, {micro_batch(corpus, {8, 0}, 0)}}, 1),
                 in_round(GroupPlan{2, 1, {micro_batch(corpus, {1}, 2)}}, 1),
                 in_round(GroupPlan{3, 1, {micro_batch(corpus, {2, 3}, 0)}}, 1),
                 in_round(ring_group(0, 4, {micro_batch(corpus, {7, 6}, 3)}, SpMode::kUlyssesRing, 2), 2)}),
      // Four rounds, each rank in a differently sized group every round.
      make_plan({in_round(GroupPlan{0, 1, {micro_batch(corpus, {0}, 0)}}, 0),
                 in_round(GroupPlan{1, 1, {micro_batch(corpus, {1}, 0)}}, 0),
                 in_round(ring_group(2, 2, {micro_batch(corpus, {5}, 1)}, SpMode::kRing), 0),
                 in_round(GroupPlan{0, 4, {micro_batch(corpus, {10}, 1)}}, 1),
                 in_round(GroupPlan{0, 2, {micro_batch(corpus, {4}, 2)}}, 2),
                 in_round(GroupPlan{2, 1, {micro_batch(corpus, {2}, 0)}}, 2),
                 in_round(GroupPlan{3, 1, {micro_batch(corpus, {3}, 3)}}, 2),
                 in_round(ring_group(0, 4, {micro_batch(corpus, {11}, 0)}, SpMode::kRing), 3)}),
  };
  for (size_t i = 0; i < plans.size(); ++i) {
    SCOPED_TRACE("plan " + std::to_string(i));
    ASSERT_EQ(plans[i].num_rounds(), static_cast<int64_t>(i) + 2);
    plans[i].validate(4, corpus.samples(), cfg.model.n_layers);
    expect_step_matches_reference(cfg, corpus, plans[i]);
    // Every rank timed each of its rounds.
    Transformer model = fresh_model(cfg);
    const StepStats r = compute_step_gradients(model, corpus, plans[i], groups());
    ASSERT_EQ(r.rank_round_s.size(), 4u);
    for (const auto& rounds : r.rank_round_s) EXPECT_EQ(rounds.size(), static_cast<size_t>(plans[i].num_rounds()));
  }
}
