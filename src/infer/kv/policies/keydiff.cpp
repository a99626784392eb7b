// KeyDiff: keep the keys least similar to the head's mean key direction.
#include "infer/kv/policies/keydiff.h"

namespace dcp {

torch::Tensor KeyDiffScorer::score(const KvCache& cache, const KvObservations*, int64_t layer, int64_t head,
                                   int64_t) const {
  const torch::Tensor k = cache.view(layer, head).keys.to(torch::kFloat);  // [n, d]
  const torch::Tensor unit = k / k.norm(2, 1, true).clamp_min(1e-12);
  const torch::Tensor anchor = unit.mean(0);                             // [d], not renormalised (kvpress)
  // cosine(k_i, anchor) = unit_i . anchor / ||anchor|| (F.cosine_similarity's eps 1e-8).
  return -torch::matmul(unit, anchor) / anchor.norm().clamp_min(1e-8);
}

}  // namespace dcp
