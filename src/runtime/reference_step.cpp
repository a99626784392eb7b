#include <fmt/format.h>

#include "dcp/step_runner.h"

namespace dcp {

double reference_step_gradients(Transformer& model, const Corpus& corpus, const StepPlan& plan) {
  const std::vector<int64_t> ids = plan.sample_ids();
  for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
  torch::Tensor loss = model->loss_sum(make_batch(corpus, ids)) / static_cast<double>(plan.global_num_tokens);
  loss.backward();
  return loss.item<double>();
}

GradientComparison compare_gradients(Transformer& model, Transformer& reference) {
  auto a = model->parameters(), b = reference->parameters();
  if (a.size() != b.size()) {
    throw std::invalid_argument(fmt::format("compare_gradients: {} vs {} parameters", a.size(), b.size()));
  }
  GradientComparison c;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!a[i].sizes().equals(b[i].sizes())) {
      throw std::invalid_argument(fmt::format("compare_gradients: parameter {} shapes differ", i));
    }
    auto ga = a[i].grad().defined() ? a[i].grad() : torch::zeros_like(a[i]);
    auto gb = b[i].grad().defined() ? b[i].grad() : torch::zeros_like(b[i]);
    c.max_abs_err = std::max(c.max_abs_err, (ga - gb).abs().max().item<double>());
    c.max_abs_ref = std::max(c.max_abs_ref, gb.abs().max().item<double>());
  }
  c.max_rel_err = c.max_abs_ref > 0 ? c.max_abs_err / c.max_abs_ref : c.max_abs_err;
  return c;
}

}  // namespace dcp
