// Recording what the queries did for attention-scoring compression policies.
#include <fmt/format.h>

#include <limits>
#include <stdexcept>

#include "dcp/kv_observations.h"
#include "infer/kv/rotation.h"

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

KvObservations::KvObservations(int64_t layers, int64_t heads, const KvObservationNeeds& needs, int64_t query_heads,
                               double rope_theta)
    : needs_(needs), layers_(layers), heads_(heads), query_heads_(query_heads == 0 ? heads : query_heads),
      rope_theta_(rope_theta) {
  if (layers < 1 || heads < 1 || needs.window < 0 || needs.query_stats_skip < 0 || query_heads_ < heads ||
      query_heads_ % heads != 0 || !(rope_theta > 0)) {
    throw std::invalid_argument(fmt::format(
        "KvObservations: layers {} and heads {} must be >= 1, query_heads {} a multiple of heads (0 = heads), window {} "
        "and query_stats_skip {} >= 0, rope_theta {} > 0",
        layers, heads, query_heads, needs.window, needs.query_stats_skip, rope_theta));
  }
  clear();
}

void KvObservations::clear() {
  scale_ = 0;
  queries_.assign(static_cast<size_t>(layers_), torch::Tensor());
  query_positions_.assign(static_cast<size_t>(layers_), torch::Tensor());
  tracks_.assign(static_cast<size_t>(layers_ * heads_), Track{});
  stats_count_.assign(static_cast<size_t>(layers_), 0);
  stats_sum_.assign(static_cast<size_t>(layers_), torch::Tensor());
  stats_outer_.assign(static_cast<size_t>(layers_), torch::Tensor());
}

void KvObservations::observe(int64_t layer, const torch::Tensor& q, const torch::Tensor& positions,
                             const KvCache& cache, double scale) {
  if (layer < 0 || layer >= layers_) {
    throw std::invalid_argument(fmt::format("KvObservations::observe: layer {} outside [0, {})", layer, layers_));
  }
  if (q.dim() != 3 || q.size(1) != query_heads_ || positions.dim() != 1 || positions.numel() != q.size(0) ||
      cache.spec().kv_heads != heads_) {
    throw std::invalid_argument(fmt::format(
        "KvObservations::observe: layer {}: q must be [T, {}, d] with T positions and the cache {} KV heads, got q {}, "
        "{} positions and a cache of {} KV heads",
        layer, query_heads_, heads_, c10::str(q.sizes()), positions.numel(), cache.spec().kv_heads));
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
  if (needs_.query_stats) {
    // Pre-rotary queries (the rotation undone) of the positions counted, summed with their outer products.
    const torch::Tensor pos = positions.to(torch::kInt64);
    const torch::Tensor counted = (pos >= needs_.query_stats_skip).nonzero().flatten();
    if (counted.numel() > 0) {
      const torch::Tensor pre = kv_rotate(q.index_select(0, counted), pos.index_select(0, counted), rope_theta_, -1.0)
                                    .transpose(0, 1);  // [heads, t, d] fp64
      const auto l = static_cast<size_t>(layer);
      const torch::Tensor sum = pre.sum(1), outer = torch::matmul(pre.transpose(1, 2), pre);
      stats_sum_[l] = stats_sum_[l].defined() ? stats_sum_[l] + sum : sum;
      stats_outer_[l] = stats_outer_[l].defined() ? stats_outer_[l] + outer : outer;
      stats_count_[l] += counted.numel();
    }
  }
  if (!needs_.attention) return;
  const torch::Tensor qpos = positions.to(torch::kInt64).unsqueeze(1);  // [T, 1]
  const int64_t g = group(), T = q.size(0);
  for (int64_t h = 0; h < heads_; ++h) {
    const KvHeadView view = cache.view(layer, h);
    Track& t = tracks_[static_cast<size_t>(layer * heads_ + h)];
    // The softmax each query of the chunk computed, per query head of the group ([g x T, n], head-major):
    // entries at later positions (the chunk's causal part) masked. The group's mean is the KV head's record.
    const torch::Tensor qg = qf.narrow(1, h * g, g).transpose(0, 1).reshape({g * T, qf.size(2)});
    torch::Tensor logits = scale * torch::matmul(qg, view.keys.to(torch::kFloat).t()) + view.bias.unsqueeze(0);
    logits = logits.masked_fill(view.positions.unsqueeze(0) > qpos.repeat({g, 1}),
                                -std::numeric_limits<float>::infinity());
    const torch::Tensor p = torch::softmax(logits, 1).view({g, T, -1}).mean(0);  // [T, n]
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

torch::Tensor KvObservations::last_attention_at(int64_t layer, int64_t head, const torch::Tensor& positions) const {
  if (!needs_.attention) {
    throw std::logic_error("KvObservations::last_attention_at: attention is not recorded (KvObservationNeeds::attention)");
  }
  if (layer < 0 || layer >= layers_ || head < 0 || head >= heads_) {
    throw std::invalid_argument(fmt::format("KvObservations::last_attention_at: layer {} or head {} outside [0, {}) x "
                                            "[0, {})", layer, head, layers_, heads_));
  }
  const Track& t = tracks_[static_cast<size_t>(layer * heads_ + head)];
  return align(t.positions, t.last, positions.to(torch::kInt64));
}

KvQueryStats KvObservations::query_stats(int64_t layer) const {
  if (!needs_.query_stats) {
    throw std::logic_error("KvObservations::query_stats: query statistics are not recorded (KvObservationNeeds::query_stats)");
  }
  if (layer < 0 || layer >= layers_) {
    throw std::invalid_argument(fmt::format("KvObservations::query_stats: layer {} outside [0, {})", layer, layers_));
  }
  const auto l = static_cast<size_t>(layer);
  KvQueryStats out;
  out.count = stats_count_[l];
  if (out.count == 0) return out;
  const auto n = static_cast<double>(out.count);
  out.mean = stats_sum_[l] / n;
  out.cov = stats_outer_[l] / n - out.mean.unsqueeze(2) * out.mean.unsqueeze(1);
  return out;
}

}  // namespace dcp
