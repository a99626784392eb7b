// H2O: heavy hitters by accumulated attention, plus a protected recent window.
#include "infer/kv/policies/h2o.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <stdexcept>

namespace dcp {

torch::Tensor H2oScorer::score(const KvCache& cache, const KvObservations* observations, int64_t layer, int64_t head,
                               int64_t budget) const {
  if (observations == nullptr) throw std::invalid_argument("H2oScorer: needs observations (accumulated attention)");
  torch::Tensor s = observations->accumulated_attention(cache, layer, head);
  const int64_t n = s.numel();
  const int64_t recent = std::min(n, static_cast<int64_t>(std::ceil(recent_fraction_ * static_cast<double>(budget))));
  if (recent > 0) s.narrow(0, n - recent, recent).fill_(std::numeric_limits<float>::infinity());
  return s;
}

}  // namespace dcp
