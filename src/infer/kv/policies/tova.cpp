// TOVA: the attention of the current (latest) query.
#include "infer/kv/policies/tova.h"

#include <stdexcept>

namespace dcp {

torch::Tensor TovaScorer::score(const KvCache& cache, const KvObservations* observations, int64_t layer, int64_t head,
                                int64_t) const {
  if (observations == nullptr) throw std::invalid_argument("TovaScorer: needs observations (the last query's attention)");
  return observations->last_attention(cache, layer, head);
}

}  // namespace dcp
