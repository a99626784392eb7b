// The policy that keeps each head's top-scored entries under its budget (src/infer/kv/policies/scored.h).
#include "infer/kv/policies/scored.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "infer/kv/policies/top.h"

namespace dcp {

ScoredKvPolicy::ScoredKvPolicy(std::shared_ptr<const KvScorer> scorer, KvBudget budget)
    : scorer_(std::move(scorer)), budget_(budget) {
  if (!scorer_) throw std::invalid_argument("ScoredKvPolicy: scorer is null");
  if (!(budget.ratio > 0 && budget.ratio <= 1) || budget.interval < 1 || budget.max_tokens < 0) {
    throw std::invalid_argument(fmt::format(
        "ScoredKvPolicy: budget {} must be in (0, 1], interval {} >= 1 and max_tokens {} >= 0", budget.ratio,
        budget.interval, budget.max_tokens));
  }
}

void ScoredKvPolicy::after_step(KvCache& cache, const KvStep& step) {
  for (int64_t layer = 0; layer < cache.spec().layers; ++layer) after_layer(cache, layer, step);
}

void ScoredKvPolicy::after_layer(KvCache& cache, int64_t layer, const KvStep& step) {
  if (!budget_.due(step)) return;
  torch::NoGradGuard no_grad;
  const int64_t heads = cache.spec().kv_heads;
  const int64_t budget = budget_.per_head(cache, layer);
  std::vector<KvHeadEdit> edits(static_cast<size_t>(heads));
  bool any = false;
  for (int64_t h = 0; h < heads; ++h) {
    if (cache.length(layer, h) <= budget) continue;  // nothing to drop: no scoring either
    edits[static_cast<size_t>(h)].keep = kv_keep_top(scorer_->score(cache, step.observations, layer, h, budget), budget);
    any = any || edits[static_cast<size_t>(h)].keep.defined();
  }
  if (any) cache.commit(layer, edits);
}

}  // namespace dcp
