// Expected Attention: the attention an entry would get, on average, from queries drawn from a Gaussian fitted to
// the recent ones.
#include "infer/kv/policies/expected_attention.h"

#include <fmt/format.h>

#include <limits>
#include <stdexcept>

namespace dcp {

torch::Tensor ExpectedAttentionScorer::score(const KvCache& cache, const KvObservations* observations, int64_t layer,
                                             int64_t head, int64_t) const {
  if (observations == nullptr || !observations->window_queries(layer).defined()) {
    throw std::invalid_argument(
        fmt::format("ExpectedAttentionScorer: layer {}: no observed queries (needs window {})", layer, window_));
  }
  const KvHeadView view = cache.view(layer, head);
  const torch::Tensor q = observations->window_queries(layer).select(0, head);  // [w, d]
  const torch::Tensor mu = q.mean(0);                                           // [d]
  const torch::Tensor centred = q - mu;
  const torch::Tensor sigma = torch::matmul(centred.t(), centred) / static_cast<double>(q.size(0));  // [d, d], ML
  const double s = observations->scale();
  const torch::Tensor k = view.keys.to(torch::kFloat);
  // log E[exp(s q.k)] for q ~ N(mu, Sigma): the Gaussian moment generating function at s k.
  const torch::Tensor log_expected =
      s * torch::matmul(k, mu) + 0.5 * s * s * (torch::matmul(k, sigma) * k).sum(1) + view.bias;
  return torch::softmax(log_expected, 0).masked_fill(view.positions < n_sink_, std::numeric_limits<float>::infinity());
}

}  // namespace dcp
