// Expected Attention: the attention an entry would get, on average, from future queries drawn from a Gaussian
// fitted to the queries seen so far (before rotary), rotated by the mean rotation of the next positions.
#include "infer/kv/policies/expected_attention.h"

#include <fmt/format.h>

#include <limits>
#include <stdexcept>

#include "infer/kv/rotation.h"

namespace dcp {

torch::Tensor ExpectedAttentionScorer::score(const KvCache& cache, const KvObservations* observations, int64_t layer,
                                             int64_t head, int64_t) const {
  if (observations == nullptr) {
    throw std::invalid_argument(fmt::format("ExpectedAttentionScorer: layer {}: needs the query statistics", layer));
  }
  const KvHeadView view = cache.view(layer, head);
  const torch::Tensor positions = view.positions;
  const torch::Tensor scored = (positions >= n_sink_).nonzero().flatten();
  const float inf = std::numeric_limits<float>::infinity();
  torch::Tensor out = torch::full({view.length()}, inf, torch::kFloat);  // sinks: protected
  const KvQueryStats stats = observations->query_stats(layer);
  if (scored.numel() == 0) return out;
  if (stats.count == 0) {
    out.index_fill_(0, scored, 0.0);  // no query past the sinks yet: nothing to expect, every entry alike
    return out;
  }
  const int64_t g = observations->group(), d = view.keys.size(1);
  const double s = observations->scale();
  const torch::Tensor rbar = kv_mean_rotation(d, cache.next_position(layer), n_future_, observations->rope_theta());
  const torch::Tensor mu = torch::matmul(stats.mean.narrow(0, head * g, g), rbar.t());  // [g, d]: Rbar mu
  const torch::Tensor sigma = torch::matmul(torch::matmul(rbar, stats.cov.narrow(0, head * g, g)), rbar.t());
  const torch::Tensor k = view.keys.index_select(0, scored).to(torch::kDouble);  // [m, d]
  // log E[exp(s q.k)] for q ~ N(mu', Sigma'), per query head: [g, m].
  const torch::Tensor log_expected = s * torch::matmul(mu, k.t()) +
                                     0.5 * s * s * (torch::matmul(k.unsqueeze(0), sigma) * k.unsqueeze(0)).sum(2) +
                                     view.bias.index_select(0, scored).to(torch::kDouble).unsqueeze(0);
  torch::Tensor score = torch::softmax(log_expected, 1).mean(0);  // the group's mean
  if (value_norm_) score = score * view.values.index_select(0, scored).to(torch::kDouble).norm(2, 1);
  out.index_copy_(0, scored, score.to(torch::kFloat));
  return out;
}

}  // namespace dcp
