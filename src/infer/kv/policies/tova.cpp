// TOVA: the attention of the current (latest) query, averaged over the layer's heads.
#include "infer/kv/policies/tova.h"

#include <limits>
#include <stdexcept>

namespace dcp {

torch::Tensor TovaScorer::score(const KvCache& cache, const KvObservations* observations, int64_t layer, int64_t head,
                                int64_t) const {
  if (observations == nullptr) throw std::invalid_argument("TovaScorer: needs observations (the last query's attention)");
  const torch::Tensor positions = cache.view(layer, head).positions;
  const int64_t heads = cache.spec().kv_heads;
  torch::Tensor s = torch::zeros({positions.numel()}, torch::kFloat);
  for (int64_t h = 0; h < heads; ++h) s += observations->last_attention_at(layer, h, positions);
  s /= static_cast<double>(heads);
  // The newest entry is kept (kvpress pads it with the maximum score).
  if (s.numel() > 0) s[s.numel() - 1] = std::numeric_limits<float>::infinity();
  return s;
}

}  // namespace dcp
