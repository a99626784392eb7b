// Zigzag ring attention without a group: the sharding of every SP layout, and the ring's partial blocks (as
// every rank of a simulated ring computes them) merging to exact attention over the whole stream, forward and
// backward, against the reference operator. The distributed runs are in tests/distributed/test_dist_sp.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <numeric>

#include "dcp/attention_kernels.h"
#include "dcp/sp_layout.h"
#include "dist/ring_blocks.h"

using namespace dcp;

namespace {

using Pieces = std::vector<std::pair<int64_t, int64_t>>;

std::vector<int64_t> stream_cu(const std::vector<int64_t>& lengths, int64_t multiple) {
  std::vector<int64_t> cu{0};
  for (int64_t l : lengths) cu.push_back(cu.back() + l);
  const int64_t padded = (cu.back() + multiple - 1) / multiple * multiple;
  if (padded > cu.back()) cu.push_back(padded);
  return cu;
}

torch::Tensor gather(const torch::Tensor& t, const Pieces& pieces) {
  std::vector<torch::Tensor> parts;
  for (const auto& [b, e] : pieces) parts.push_back(t.slice(0, b, e));
  return torch::cat(parts);
}

}  // namespace

TEST(SpLayout, EveryTokenHasExactlyOneOwnerAndRingsHoldZigzagChunks) {
  for (auto [sp, u] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {2, 2}, {4, 4}, {3, 3}, {2, 1}, {4, 1},
                                                               {3, 1}, {4, 2}, {8, 2}, {6, 3}, {8, 4}}) {
    const SpLayout layout{sp, u};
    const int64_t r = layout.ring_size();
    SCOPED_TRACE("sp " + std::to_string(sp) + " ulysses " + std::to_string(u));
    EXPECT_EQ(layout.pad_multiple(), r > 1 ? 2 * sp : sp);
    for (int64_t padded : {layout.pad_multiple(), 7 * layout.pad_multiple()}) {
      std::vector<int> owners(static_cast<size_t>(padded), 0);
      for (int64_t rank = 0; rank < sp; ++rank) {
        int64_t held = 0;
        for (const auto& [b, e] : layout.shard(padded, rank)) {
          for (int64_t t = b; t < e; ++t) ++owners[static_cast<size_t>(t)];
          held += e - b;
        }
        EXPECT_EQ(held, padded / sp);
      }
      EXPECT_TRUE(std::all_of(owners.begin(), owners.end(), [](int n) { return n == 1; }));
      if (r == 1) continue;
      // A subgroup's members, in order, hold ring position j's two chunks in stream order.
      for (int64_t j = 0; j < r; ++j) {
        Pieces together;
        for (int64_t m = 0; m < u; ++m) {
          for (const auto& p : layout.shard(padded, j * u + m)) together.push_back(p);
        }
        std::vector<int64_t> tokens, want;
        for (const auto& [b, e] : together)
          for (int64_t t = b; t < e; ++t) tokens.push_back(t);
        for (const auto& [b, e] : ring_position_pieces(padded, r, j))
          for (int64_t t = b; t < e; ++t) want.push_back(t);
        EXPECT_EQ(tokens, want) << "ring position " << j;
      }
    }
  }
  EXPECT_EQ(SpLayout({4, 1}).shard(16, 1), (Pieces{{2, 4}, {12, 14}}));  // chunks 1 and 6 of 8
  EXPECT_THROW(SpLayout({4, 1}).shard(12, 0), std::invalid_argument);    // not a multiple of 8
  EXPECT_THROW(SpLayout({4, 1}).shard(16, 4), std::invalid_argument);
  EXPECT_THROW(SpLayout({4, 3}).shard(16, 0), std::invalid_argument);
}

TEST(RingBlocks, PartialBlocksMergeToExactAttentionForwardAndBackward) {
  torch::manual_seed(3);
  const int64_t heads = 2, dim = 8;
  // A long sample spanning every chunk, short ones (shorter than a chunk, one of a single token), padding.
  for (int64_t r : {2, 3, 4}) {
    const auto cu = stream_cu({61, 5, 1, 23, 9}, 2 * r);
    const int64_t padded = cu.back();
    SCOPED_TRACE("ring " + std::to_string(r) + ", stream " + std::to_string(padded));
    auto opts = torch::dtype(torch::kDouble);
    auto q = torch::randn({padded, heads, dim}, opts).requires_grad_(), k = torch::randn({padded, heads, dim}, opts).requires_grad_(),
         v = torch::randn({padded, heads, dim}, opts).requires_grad_();
    auto cu_t = torch::tensor(cu, torch::kInt64);
    AttentionResult want = reference_attention(q, k, v, cu_t, cu_t, true);
    auto dout = torch::randn_like(want.out);
    want.out.backward(dout);

    std::vector<Pieces> held;
    for (int64_t j = 0; j < r; ++j) held.push_back(ring_position_pieces(padded, r, j));
    std::vector<torch::Tensor> dk(static_cast<size_t>(r)), dv(static_cast<size_t>(r));
    for (int64_t p = 0; p < r; ++p) {
      dk[p] = torch::zeros({2 * padded / (2 * r), heads, dim}, opts);
      dv[p] = torch::zeros_like(dk[p]);
    }
    for (int64_t j = 0; j < r; ++j) {
      auto qj = gather(q.detach(), held[j]), oj = gather(want.out.detach(), held[j]),
           lj = gather(want.lse.detach(), held[j]), dj = gather(dout, held[j]);
      AttentionResult merged{torch::zeros_like(qj), torch::full_like(lj, -INFINITY)};
      auto dq = torch::zeros_like(qj);
      for (int64_t p = 0; p < r; ++p) {
        const RingBlock b = ring_block(cu, r, j, p);
        if (b.empty) continue;
        auto kp = gather(k.detach(), held[p]).slice(0, b.k_begin, b.k_end),
             vp = gather(v.detach(), held[p]).slice(0, b.k_begin, b.k_end);
        auto qb = qj.slice(0, b.q_begin, b.q_end);
        auto cq = torch::tensor(b.cu_q, torch::kInt64), ck = torch::tensor(b.cu_k, torch::kInt64);
        AttentionResult part = tiled_attention_forward(qb, kp, vp, cq, ck, b.causal);
        AttentionResult rows{merged.out.slice(0, b.q_begin, b.q_end), merged.lse.slice(0, b.q_begin, b.q_end)};
        AttentionResult m = merge_attention(rows, part);
        rows.out.copy_(m.out);
        rows.lse.copy_(m.lse);
        // Backward with the final (merged) out and lse: each block's exact share.
        AttentionGrads g = tiled_attention_backward(dj.slice(0, b.q_begin, b.q_end), qb, kp, vp,
                                                    oj.slice(0, b.q_begin, b.q_end), lj.slice(0, b.q_begin, b.q_end),
                                                    cq, ck, b.causal);
        dq.slice(0, b.q_begin, b.q_end).add_(g.dq);
        dk[p].slice(0, b.k_begin, b.k_end).add_(g.dk);
        dv[p].slice(0, b.k_begin, b.k_end).add_(g.dv);
      }
      EXPECT_LT((merged.out - oj).abs().max().item<double>(), 1e-12) << "position " << j;
      EXPECT_LT((merged.lse - lj).abs().max().item<double>(), 1e-12) << "position " << j;
      EXPECT_LT((dq - gather(q.grad(), held[j])).abs().max().item<double>(), 1e-11) << "position " << j;
    }
    for (int64_t p = 0; p < r; ++p) {
      EXPECT_LT((dk[p] - gather(k.grad(), held[p])).abs().max().item<double>(), 1e-11) << "position " << p;
      EXPECT_LT((dv[p] - gather(v.grad(), held[p])).abs().max().item<double>(), 1e-11) << "position " << p;
    }
  }
}

TEST(RingBlocks, OneLongSampleCostsTheSameOnEveryRankAtEveryStep) {
  const int64_t r = 4, padded = 64, c = padded / (2 * r);
  const std::vector<int64_t> cu{0, padded};
  for (int64_t j = 0; j < r; ++j) {
    for (int64_t p = 0; p < r; ++p) {
      const RingBlock b = ring_block(cu, r, j, p);
      EXPECT_FALSE(b.empty);
      EXPECT_EQ(b.causal, p == j);
      // Off the diagonal: c queries x 2c keys or 2c x c; on it, 2c x 2c causal (half of it).
      if (p != j) EXPECT_EQ((b.q_end - b.q_begin) * (b.k_end - b.k_begin), 2 * c * c);
    }
  }
  // Samples no longer than a chunk, each inside one: the off-diagonal steps have nothing to compute.
  EXPECT_TRUE(ring_block({0, 4, 8, 12, 16}, 2, 1, 0).empty);
  EXPECT_TRUE(ring_block({0, 4, 8, 12, 16}, 2, 0, 1).empty);
  EXPECT_FALSE(ring_block({0, 4, 8, 12, 16}, 2, 0, 0).empty);
  EXPECT_FALSE(ring_block({0, 5, 16}, 2, 1, 0).empty);  // sample 0 reaches from chunk 0 into chunk 1
  EXPECT_THROW(ring_position_pieces(10, 2, 0), std::invalid_argument);
  EXPECT_THROW(ring_position_pieces(16, 1, 0), std::invalid_argument);
  EXPECT_THROW(ring_block({0, 16}, 2, 2, 0), std::invalid_argument);
}
