// Shared by the scored policies: which entries a head keeps given its scores.
#pragma once

#include <torch/types.h>

#include <algorithm>
#include <cstdint>

namespace dcp {

/// The indices of the max(k, protected) highest of `scores` [n] (protected = the +infinity ones), ascending so
/// that the kept entries stay in sequence order as KvCache::commit requires; undefined when that is all n.
inline torch::Tensor kv_keep_top(const torch::Tensor& scores, int64_t k) {
  const int64_t n = scores.numel();
  const int64_t protected_count = torch::isposinf(scores).sum().item<int64_t>();
  k = std::max(k, protected_count);
  if (k >= n) return torch::Tensor();
  return std::get<0>(torch::sort(std::get<1>(torch::topk(scores, k, 0, /*largest=*/true, /*sorted=*/false))));
}

}  // namespace dcp
