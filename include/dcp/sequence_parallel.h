// Ulysses sequence parallelism (Jacobs et al. 2023, DeepSpeed-Ulysses): around attention, an all-to-all turns
// sequence shards into head shards and back.
#pragma once

#include <memory>

#include "dcp/dist.h"
#include "dcp/model.h"

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

}  // namespace dcp
