// StreamingLLM: attention sinks plus the most recent entries.
#include "infer/kv/policies/window.h"

#include <limits>

namespace dcp {

torch::Tensor WindowScorer::score(const KvCache& cache, const KvObservations*, int64_t layer, int64_t head,
                                  int64_t) const {
  const torch::Tensor positions = cache.view(layer, head).positions;
  // Recency is the position itself; the sinks (the sequence's first positions) are never evicted.
  return positions.to(torch::kFloat).masked_fill(positions < n_sink_, std::numeric_limits<float>::infinity());
}

}  // namespace dcp
