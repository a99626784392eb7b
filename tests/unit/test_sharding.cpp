#include <gtest/gtest.h>

#include "dcp/config.h"
#include "dcp/dist.h"
#include "dcp/model.h"

using namespace dcp;

namespace {

Corpus small_corpus() {
  DataConfig cfg;
  cfg.max_seq_len = 16;
  cfg.heldout_fraction = 0;
  return Corpus::from_documents({{"a", "hello world"}, {"b", "0123456789abcdefXYZ"}, {"c", "q"}}, cfg);
}

}  // namespace

TEST(Sharding, ShardsConcatenateToTheBatchPlusPadding) {
  Corpus corpus = small_corpus();  // samples of 11, 16, 3 and 1 tokens: a stream of 31
  const std::vector<int64_t> ids = {0, 1, 2, 3};
  PackedBatch full = make_batch(corpus, ids);
  ASSERT_EQ(full.num_tokens(), 31);
  for (int64_t sp : {1, 2, 3, 4, 8}) {
    std::vector<torch::Tensor> tokens, targets, positions;
    for (int64_t r = 0; r < sp; ++r) {
      PackedBatch s = make_shard(corpus, ids, r, sp);
      EXPECT_EQ(s.num_tokens() * sp, (31 + sp - 1) / sp * sp);
      tokens.push_back(s.tokens);
      targets.push_back(s.targets);
      positions.push_back(s.positions);
      const int64_t padded = (31 + sp - 1) / sp * sp;
      EXPECT_EQ(s.cu_seqlens[-1].item<int64_t>(), padded);  // padding is its own segment
      EXPECT_EQ(s.cu_seqlens.numel(), padded > 31 ? 6 : 5);
    }
    auto t = torch::cat(tokens), y = torch::cat(targets), p = torch::cat(positions);
    EXPECT_TRUE(torch::equal(t.slice(0, 0, 31), full.tokens)) << "sp " << sp;
    EXPECT_TRUE(torch::equal(y.slice(0, 0, 31), full.targets)) << "sp " << sp;
    EXPECT_TRUE(torch::equal(p.slice(0, 0, 31), full.positions)) << "sp " << sp;
    EXPECT_TRUE((y.slice(0, 31) == -100).all().item<bool>());
  }
  EXPECT_THROW(make_shard(corpus, ids, 2, 2), std::invalid_argument);
  EXPECT_THROW(make_shard(corpus, {}, 0, 1), std::invalid_argument);
  EXPECT_THROW(make_shard(corpus, {7}, 0, 1), std::out_of_range);
}

TEST(Sharding, SpSizesResolveForAnyWorldSize) {
  EXPECT_EQ(resolve_sp_sizes("pow2", 8), (std::vector<int64_t>{1, 2, 4, 8}));
  EXPECT_EQ(resolve_sp_sizes("pow2", 6), (std::vector<int64_t>{1, 2, 6}));
  EXPECT_EQ(resolve_sp_sizes("all", 6), (std::vector<int64_t>{1, 2, 3, 6}));
  EXPECT_EQ(resolve_sp_sizes("3", 6), (std::vector<int64_t>{1, 3, 6}));
  EXPECT_THROW(resolve_sp_sizes("4", 6), ConfigError);
  EXPECT_THROW(resolve_sp_sizes("2,x", 6), ConfigError);
  EXPECT_THROW(resolve_sp_sizes("", 6), ConfigError);
}
