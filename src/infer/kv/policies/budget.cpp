// A budget ratio and a trigger: when a policy compresses and how much (KvBudget, dcp/kv_policy.h).
#include <algorithm>
#include <cmath>

#include "infer/kv/policies/scorer.h"

namespace dcp {

int64_t KvBudget::per_head(const KvCache& cache, int64_t layer) const {
  const auto share = static_cast<int64_t>(std::ceil(ratio * static_cast<double>(cache.next_position(layer))));
  return max_tokens > 0 ? std::min(share, max_tokens) : share;
}

bool KvBudget::due(const KvStep& step) const {
  return step.prefill || (step.first_position + step.tokens) % interval == 0;
}

}  // namespace dcp
