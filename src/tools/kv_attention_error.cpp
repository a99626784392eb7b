// Attention over a compressed cache against the full one for given queries (kv-eval's operator fidelity).
#include <fmt/format.h>
#include <torch/torch.h>

#include <cmath>
#include <stdexcept>

#include "infer/kv/summary.h"
#include "tools/kv_eval.h"

namespace dcp {
namespace {

// softmax(scale q.K^T + bias) V over one view, fp64: [T, value_dim].
torch::Tensor attend(const KvHeadView& view, const torch::Tensor& q, double scale) {
  return torch::matmul(kv_head_probs(view, q, scale), view.values.to(torch::kFloat64));
}

}  // namespace

torch::Tensor kv_attention_rel_err(const KvHeadView& full, const KvHeadView& compressed,
                                   const torch::Tensor& queries, double scale) {
  if (full.length() < 1 || compressed.length() < 1) {
    throw std::invalid_argument(fmt::format("kv_attention_rel_err: empty view (full {} entries, compressed {})",
                                            full.length(), compressed.length()));
  }
  if (!(scale > 0)) throw std::invalid_argument(fmt::format("kv_attention_rel_err: scale {} must be > 0", scale));
  if (queries.dim() != 2 || queries.size(1) != full.keys.size(1) || compressed.keys.size(1) != full.keys.size(1) ||
      compressed.values.size(1) != full.values.size(1)) {
    throw std::invalid_argument(fmt::format(
        "kv_attention_rel_err: queries of shape {} and head_dim {} / {}, value_dim {} / {} (full / compressed) do not fit",
        c10::str(queries.sizes()), full.keys.size(1), compressed.keys.size(1), full.values.size(1),
        compressed.values.size(1)));
  }
  torch::NoGradGuard no_grad;
  const torch::Tensor q = queries.to(torch::kFloat64);
  const torch::Tensor of = attend(full, q, scale), oc = attend(compressed, q, scale);
  // An output of norm 0 (all values 0) has error 0 when the compressed one is 0 too, else infinite.
  const torch::Tensor diff = (oc - of).pow(2).sum(1).sqrt(), ref = of.pow(2).sum(1).sqrt();
  return torch::where(ref > 0, diff / ref,
                      torch::where(diff > 0, torch::full_like(diff, INFINITY), torch::zeros_like(diff)));
}

}  // namespace dcp
