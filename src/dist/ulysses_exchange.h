// The two all-to-alls of Ulysses (Jacobs et al. 2023), shared by Ulysses and the Ulysses part of ulysses-ring.
#pragma once

#include <torch/types.h>

#include <array>

#include "dcp/dist.h"

namespace dcp {

/// q [T_local, heads, head_dim], k, v [T_local, kv_heads, head_dim] of every member -> [T_local x size,
/// heads / size, head_dim] and [T_local x size, kv_heads / size, head_dim]: the group's tokens in member order,
/// query heads [rank x heads / size, (rank + 1) x heads / size) and the K/V heads that serve them (grouped-query
/// attention, kv_heads dividing heads). One differentiable all-to-all for the three. Throws
/// std::invalid_argument when heads or kv_heads is not divisible by the group size.
std::array<torch::Tensor, 3> ulysses_to_heads(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                              const Communicator& group);

/// The inverse for the attention output: [T_local x size, heads / size, head_dim] -> [T_local, heads, head_dim].
torch::Tensor ulysses_to_tokens(const torch::Tensor& out, const Communicator& group);

}  // namespace dcp
