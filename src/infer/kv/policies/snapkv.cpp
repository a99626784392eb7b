// SnapKV: attention of an observation window of recent queries, average-pooled so that neighbours survive together.
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
  const int64_t g = observations->group();
  const torch::Tensor q = observations->window_queries(layer).narrow(0, head * g, g);  // [g, w, d]
  const torch::Tensor qpos = observations->window_positions(layer);                   // [w]
  // The window's attention over the cache as it is now: each query sees the entries up to its own position.
  torch::Tensor logits = observations->scale() * torch::matmul(q, view.keys.to(torch::kFloat).t()) +
                         view.bias.view({1, 1, -1});  // [g, w, n]
  logits = logits.masked_fill((view.positions.unsqueeze(0) > qpos.unsqueeze(1)).unsqueeze(0),
                              -std::numeric_limits<float>::infinity());
  const torch::Tensor mean = torch::softmax(logits, 2).mean(1);  // [g, n]
  // Entries before the window are scored (pooled among themselves, zero padding at both ends as avg_pool1d);
  // the window's own entries (positions >= its first query's) rank first, newest highest, all finite.
  const int64_t before = (view.positions < qpos[0]).sum().item<int64_t>();
  const int64_t n = view.length();
  torch::Tensor s = torch::empty({n}, torch::kFloat);
  if (before > 0) {
    const torch::Tensor pooled =
        torch::avg_pool1d(mean.narrow(1, 0, before).unsqueeze(1), {kernel_}, {1}, {kernel_ / 2}).squeeze(1);  // [g, before]
    s.narrow(0, 0, before).copy_(pooled.mean(0));
  }
  if (n > before) s.narrow(0, before, n - before).copy_(2.0 + torch::arange(n - before, torch::kFloat) / static_cast<double>(n));
  return s;
}

}  // namespace dcp
