// SnapKV: attention of an observation window of recent queries, max-pooled so that neighbours survive together.
#include "infer/kv/policies/snapkv.h"

#include <fmt/format.h>

#include <limits>
#include <stdexcept>

namespace dcp {

torch::Tensor SnapKvScorer::score(const KvCache& cache, const KvObservations* observations, int64_t layer, int64_t head,
                                  int64_t) const {
  if (observations == nullptr || !observations->window_queries(layer).defined()) {
    throw std::invalid_argument(fmt::format("SnapKvScorer: layer {}: no observed queries (needs window {})", layer, window_));
  }
  const KvHeadView view = cache.view(layer, head);
  const torch::Tensor q = observations->window_queries(layer).select(0, head);   // [w, d]
  const torch::Tensor qpos = observations->window_positions(layer).unsqueeze(1);  // [w, 1]
  const float inf = std::numeric_limits<float>::infinity();
  // The window's attention over the cache as it is now: each query sees the entries up to its own position.
  torch::Tensor logits = observations->scale() * torch::matmul(q, view.keys.to(torch::kFloat).t()) +
                         view.bias.unsqueeze(0);
  logits = logits.masked_fill(view.positions.unsqueeze(0) > qpos, -inf);
  const torch::Tensor mean = torch::softmax(logits, 1).mean(0);  // [n]
  torch::Tensor s = torch::max_pool1d(mean.view({1, 1, -1}), kernel_, 1, kernel_ / 2).view({-1});
  // The window's own entries are kept (they are what the next queries are most like).
  return s.masked_fill(view.positions >= qpos[0][0], inf);
}

}  // namespace dcp
