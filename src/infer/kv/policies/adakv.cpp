// Ada-KV: one budget for all heads of a layer, a per-head floor, the rest by scores across heads.
#include "infer/kv/policies/adakv.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "infer/kv/policies/top.h"

namespace dcp {

AdaKvPolicy::AdaKvPolicy(std::shared_ptr<const KvScorer> scorer, KvBudget budget, double alpha_safeguard)
    : scorer_(std::move(scorer)), budget_(budget), alpha_(alpha_safeguard) {
  if (!scorer_) throw std::invalid_argument("AdaKvPolicy: scorer is null");
  if (!(budget.ratio > 0 && budget.ratio <= 1) || budget.interval < 1 || budget.max_tokens < 0 ||
      !(alpha_safeguard >= 0 && alpha_safeguard <= 1)) {
    throw std::invalid_argument(fmt::format(
        "AdaKvPolicy: budget {} must be in (0, 1], interval {} >= 1, max_tokens {} >= 0 and alpha_safeguard {} in "
        "[0, 1]", budget.ratio, budget.interval, budget.max_tokens, alpha_safeguard));
  }
}

void AdaKvPolicy::after_step(KvCache& cache, const KvStep& step) {
  for (int64_t layer = 0; layer < cache.spec().layers; ++layer) after_layer(cache, layer, step);
}

void AdaKvPolicy::after_layer(KvCache& cache, int64_t layer, const KvStep& step) {
  if (!budget_.due(step)) return;
  torch::NoGradGuard no_grad;
  const int64_t heads = cache.spec().kv_heads;
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t budget = budget_.per_head(cache, layer);
  int64_t total = 0;
  for (int64_t h = 0; h < heads; ++h) total += cache.length(layer, h);
  if (total <= heads * budget) return;
  // The floor: each head's own top entries become protected before the layer-wide ranking.
  const int64_t floor = static_cast<int64_t>(std::floor(alpha_ * static_cast<double>(budget)));
  std::vector<torch::Tensor> scores;
  for (int64_t h = 0; h < heads; ++h) {
    torch::Tensor s = scorer_->score(cache, step.observations, layer, h, budget).clone();
    const int64_t f = std::min(floor, s.numel());
    if (f > 0) s.index_fill_(0, std::get<1>(torch::topk(s, f)), inf);
    scores.push_back(s);
  }
  const torch::Tensor keep_all = kv_keep_top(torch::cat(scores), heads * budget);
  if (!keep_all.defined()) return;
  // Split the layer-wide selection back into heads: head h owns the flat range [offset, offset + n_h).
  std::vector<KvHeadEdit> edits(static_cast<size_t>(heads));
  int64_t offset = 0;
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t n = scores[static_cast<size_t>(h)].numel();
    const torch::Tensor mine = keep_all.masked_select((keep_all >= offset) & (keep_all < offset + n)) - offset;
    if (mine.numel() < n) edits[static_cast<size_t>(h)].keep = mine;
    offset += n;
  }
  cache.commit(layer, edits);
}

}  // namespace dcp
