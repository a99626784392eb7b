// Recording what the queries did for attention-scoring compression policies.
#include <fmt/format.h>

#include <limits>
#include <stdexcept>

#include "dcp/kv_observations.h"

namespace dcp {
namespace {

// Values recorded for the entries at old_positions, re-indexed to new_positions (a subset of old ones plus
// entries appended since, which get 0). Both strictly increasing, as the cache keeps them.
torch::Tensor align(const torch::Tensor& old_positions, const torch::Tensor& values, const torch::Tensor& new_positions) {
  torch::Tensor out = torch::zeros({new_positions.numel()}, torch::kFloat);
  if (!old_positions.defined() || old_positions.numel() == 0 || new_positions.numel() == 0) return out;
  const torch::Tensor idx = torch::searchsorted(old_positions, new_positions).clamp_max(old_positions.numel() - 1);
  const torch::Tensor found = old_positions.index_select(0, idx) == new_positions;
  return torch::where(found, values.index_select(0, idx), out);
}

}  // namespace

KvObservations::KvObservations(int64_t layers, int64_t heads, const KvObservationNeeds& needs)
    : needs_(needs), layers_(layers), heads_(heads) {
  if (layers < 1 || heads < 1 || needs.window < 0) {
    throw std::invalid_argument(fmt::format("KvObservations: layers {} and heads {} must be >= 1, window {} >= 0",
                                            layers, heads, needs.window));
  }
  clear();
}

void KvObservations::clear() {
  scale_ = 0;
  queries_.assign(static_cast<size_t>(layers_), torch::Tensor());
  query_positions_.assign(static_cast<size_t>(layers_), torch::Tensor());
  tracks_.assign(static_cast<size_t>(layers_ * heads_), Track{});
}

void KvObservations::observe(int64_t layer, const torch::Tensor& q, const torch::Tensor& positions,
                             const KvCache& cache, double scale) {
  if (layer < 0 || layer >= layers_) {
    throw std::invalid_argument(fmt::format("KvObservations::observe: layer {} outside [0, {})", layer, layers_));
  }
  if (q.dim() != 3 || q.size(1) != heads_ || positions.dim() != 1 || positions.numel() != q.size(0) ||
      cache.spec().kv_heads != heads_) {
    throw std::invalid_argument(fmt::format(
        "KvObservations::observe: layer {}: q must be [T, {}, d] with T positions, got q {} and {} positions", layer,
        heads_, c10::str(q.sizes()), positions.numel()));
  }
  torch::NoGradGuard no_grad;
  scale_ = scale;
  const torch::Tensor qf = q.to(torch::kFloat);
  if (needs_.window > 0) {
    auto& kept = queries_[static_cast<size_t>(layer)];
    auto& kept_pos = query_positions_[static_cast<size_t>(layer)];
    kept = kept.defined() ? torch::cat({kept, qf.transpose(0, 1)}, 1) : qf.transpose(0, 1).contiguous();
    kept_pos = kept_pos.defined() ? torch::cat({kept_pos, positions.to(torch::kInt64)}) : positions.to(torch::kInt64);
    const int64_t w = kept.size(1);
    if (w > needs_.window) {
      kept = kept.narrow(1, w - needs_.window, needs_.window).contiguous();
      kept_pos = kept_pos.narrow(0, w - needs_.window, needs_.window).contiguous();
    }
  }
  if (!needs_.attention) return;
  const torch::Tensor qpos = positions.to(torch::kInt64).unsqueeze(1);  // [T, 1]
  for (int64_t h = 0; h < heads_; ++h) {
    const KvHeadView view = cache.view(layer, h);
    Track& t = tracks_[static_cast<size_t>(layer * heads_ + h)];
    // The softmax each query of the chunk computed: entries at later positions (the chunk's causal part) masked.
    torch::Tensor logits = scale * torch::matmul(qf.select(1, h), view.keys.to(torch::kFloat).t()) +
                           view.bias.unsqueeze(0);
    logits = logits.masked_fill(view.positions.unsqueeze(0) > qpos, -std::numeric_limits<float>::infinity());
    const torch::Tensor p = torch::softmax(logits, 1);  // [T, n]
    t.accumulated = align(t.positions, t.accumulated, view.positions) + p.sum(0);
    t.last = p[p.size(0) - 1].contiguous();
    t.positions = view.positions.clone();  // a copy: a view would keep the storage a commit releases
  }
}

const torch::Tensor& KvObservations::window_queries(int64_t layer) const {
  if (layer < 0 || layer >= layers_) {
    throw std::invalid_argument(fmt::format("KvObservations::window_queries: layer {} outside [0, {})", layer, layers_));
  }
  return queries_[static_cast<size_t>(layer)];
}

const torch::Tensor& KvObservations::window_positions(int64_t layer) const {
  if (layer < 0 || layer >= layers_) {
    throw std::invalid_argument(
        fmt::format("KvObservations::window_positions: layer {} outside [0, {})", layer, layers_));
  }
  return query_positions_[static_cast<size_t>(layer)];
}

const KvObservations::Track& KvObservations::track(const KvCache& cache, int64_t layer, int64_t head,
                                                   const char* who) const {
  if (!needs_.attention) {
    throw std::logic_error(fmt::format("KvObservations::{}: attention is not recorded (KvObservationNeeds::attention)", who));
  }
  if (layer < 0 || layer >= layers_ || head < 0 || head >= heads_ || cache.spec().kv_heads != heads_) {
    throw std::invalid_argument(fmt::format("KvObservations::{}: layer {} or head {} outside [0, {}) x [0, {})", who,
                                            layer, head, layers_, heads_));
  }
  return tracks_[static_cast<size_t>(layer * heads_ + head)];
}

torch::Tensor KvObservations::accumulated_attention(const KvCache& cache, int64_t layer, int64_t head) const {
  const Track& t = track(cache, layer, head, "accumulated_attention");
  return align(t.positions, t.accumulated, cache.view(layer, head).positions);
}

torch::Tensor KvObservations::last_attention(const KvCache& cache, int64_t layer, int64_t head) const {
  const Track& t = track(cache, layer, head, "last_attention");
  return align(t.positions, t.last, cache.view(layer, head).positions);
}

}  // namespace dcp
