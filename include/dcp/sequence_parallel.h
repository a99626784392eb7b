// Sequence parallelism around attention: Ulysses (Jacobs et al. 2023, DeepSpeed-Ulysses: an all-to-all turns
// sequence shards into head shards and back), ring attention (Li et al. 2021, Ring Self-Attention; Liu et al.
// 2023, arXiv 2310.01889: key/value blocks travel around the group) and the two combined (USP, arXiv 2405.07719).
#pragma once

#include <memory>

#include "dcp/attention_backend.h"
#include "dcp/dist.h"
#include "dcp/sp_layout.h"

namespace dcp {

/// Differentiable all-to-all over `group`: x [group.size() * n, ...] is cut into equal chunks along dim 0,
/// chunk j goes to member j, and the chunks received are concatenated in member order. Its backward is the
/// same all-to-all applied to the gradient (the exchange is its own inverse).
torch::Tensor all_to_all(const torch::Tensor& x, const Communicator& group);

/// Attention of a sequence shard, wrapped around each block's own backend: q, k, v [T_local, heads, head_dim]
/// of this rank's contiguous shard are exchanged into [T_local * sp, heads / sp, head_dim] (the whole stream,
/// heads [rank * heads / sp, (rank + 1) * heads / sp)), the block's backend attends over the whole stream with
/// its cu_seqlens through forward_heads(..., head_offset = rank * heads / sp) (so per-head parameters of exactly
/// those heads are used, and their gradients land in those slices), and the result goes back to
/// [T_local, heads, head_dim]. One all-to-all for q, k, v together, one for the output.
/// Throws std::invalid_argument when heads is not divisible by the group size.
class SequenceParallelAttention : public AttentionWrapper {
 public:
  /// `group` must outlive every forward and backward that uses this object.
  explicit SequenceParallelAttention(const Communicator& group);
  /// With a fixed backend, for callers that have one attention function rather than a block's backend
  /// (forward(q, k, v, cu_seqlens) below).
  SequenceParallelAttention(std::shared_ptr<const AttentionBackend> inner, const Communicator& group);

  torch::Tensor forward(const AttentionBackend& inner, int64_t layer, const torch::Tensor& q,
                        const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& cu_seqlens) const override;
  /// The same around the backend given at construction; throws std::logic_error when none was given.
  torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& cu_seqlens) const;

 private:
  std::shared_ptr<const AttentionBackend> inner_;
  const Communicator& group_;
};

/// Ring attention of a group's zigzag shards (SpMode kRing and kUlyssesRing, dcp/plan.h; docs/sequence_parallel.md
/// "Ring attention"), around a block's softmax backend. q, k, v [T_local, heads, head_dim] hold this rank's
/// pieces of the padded stream as SpLayout::shard gives them; cu_seqlens describes the whole stream.
/// 1. With ulysses_size u > 1, an all-to-all inside the subgroup of u consecutive ranks gives each member the
///    subgroup's 2 zigzag chunks (2c = u T_local tokens, in stream order) for heads / u of the heads.
/// 2. Ring of r = sp_size / u steps over the members u apart: at step i the rank holds the key/value block of
///    ring position (j - i) mod r, sends it on to position j + 1 and receives the next from j - 1 in the
///    background (Communicator::exchange) while it attends its queries to the block it holds
///    (tiled_attention_forward on the rows ring_block names); partial results merge exactly by their
///    logsumexps (merge_attention, in fp32).
/// 3. Backward (FlashAttention-2 Algorithm 2 per block with the merged out and lse, which gives each block's
///    exact share): the key/value blocks travel the ring again with a dK/dV accumulator beside them; after the
///    last step each accumulator makes one more hop to its owner.
/// The result goes back through the all-to-all. Causal inside each segment of cu_seqlens, nothing across.
/// Throws std::invalid_argument when the block's backend is not SoftmaxAttention, when heads is not divisible
/// by u, or when the shapes do not match the layout; std::runtime_error when a peer fails.
class RingAttention : public AttentionWrapper {
 public:
  /// `group`: the group's sp_size members; `ulysses`: the aligned subgroup of layout.ulysses_size consecutive
  /// members that holds this rank (a group of one for a plain ring). Both must outlive every forward and
  /// backward. Throws std::invalid_argument when their sizes do not match `layout` or the layout has no ring.
  RingAttention(const Communicator& group, const Communicator& ulysses, SpLayout layout);

  torch::Tensor forward(const AttentionBackend& inner, int64_t layer, const torch::Tensor& q,
                        const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& cu_seqlens) const override;

 private:
  const Communicator& group_;
  const Communicator& ulysses_;
  SpLayout layout_;
};

/// The attention wrapper of a group of `layout` (GroupPlan::layout() in dcp/plan.h): none for sp_size 1,
/// SequenceParallelAttention for Ulysses (ring_size 1), RingAttention for the ring modes (the subgroup from
/// groups.group(ulysses_size)). Throws std::out_of_range when a needed process group was not created.
std::shared_ptr<const AttentionWrapper> group_attention(const SpLayout& layout, const ProcessGroups& groups);

}  // namespace dcp
