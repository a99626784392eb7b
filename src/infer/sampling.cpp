// Drawing a byte from a model's logits: greedy, or temperature, top-k and top-p (nucleus) sampling with a seeded
// generator. One sampler per sequence, shared by generate and dcp serve so that both draw the same bytes.
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <stdexcept>

#include "dcp/infer.h"

namespace dcp {

ByteSampler::ByteSampler(uint64_t seed) : generator_(at::make_generator<at::CPUGeneratorImpl>(seed)) {}

namespace {

void check(const SamplingOptions& opt) {
  if (!(opt.temperature >= 0) || opt.top_k < 0 || !(opt.top_p > 0 && opt.top_p <= 1)) {
    throw std::invalid_argument(fmt::format("sampling: temperature {} must be >= 0, top_k {} >= 0, top_p {} in (0, 1]",
                                            opt.temperature, opt.top_k, opt.top_p));
  }
}

[[noreturn]] void not_finite(int64_t index) {
  throw std::runtime_error(fmt::format("generate: the model's logits for new byte {} are not finite (NaN or "
                                       "inf weights in the checkpoint?)",
                                       index));
}

}  // namespace

int64_t ByteSampler::next(const float* row, int64_t size, const SamplingOptions& opt, int64_t index) {
  check(opt);
  if (size < 256) throw std::invalid_argument(fmt::format("sampling: {} logits, fewer than the 256 bytes", size));
  if (opt.temperature != 0) {
    return next(torch::from_blob(const_cast<float*>(row), {size}, torch::kFloat), opt, index);
  }
  // Greedy: the first largest of the 256 byte logits, as argmax; no tensor is made.
  int64_t best = 0;
  for (int64_t i = 0; i < 256; ++i) {
    if (!std::isfinite(row[i])) not_finite(index);  // argmax would silently pick byte 0
    if (row[i] > row[best]) best = i;
  }
  return best;
}

int64_t ByteSampler::next(const torch::Tensor& row, const SamplingOptions& opt, int64_t index) {
  check(opt);
  if (opt.temperature == 0 && row.dim() == 1 && row.scalar_type() == torch::kFloat && row.is_cpu() &&
      row.stride(0) == 1 && row.numel() >= 256) {
    return next(row.data_ptr<float>(), row.numel(), opt, index);
  }
  torch::Tensor logits = row.slice(0, 0, 256).to(torch::kFloat64);  // bytes only
  if (!torch::isfinite(logits).all().item<bool>()) not_finite(index);  // argmax would silently pick byte 0
  if (opt.temperature == 0) return logits.argmax().item<int64_t>();
  logits = logits / opt.temperature;
  if (!torch::isfinite(logits).all().item<bool>()) {
    throw std::invalid_argument(fmt::format("generate: temperature {} is too small: logits / temperature "
                                            "overflow (use 0 for greedy decoding)",
                                            opt.temperature));
  }
  const double minus_inf = -std::numeric_limits<double>::infinity();
  if (opt.top_k > 0 && opt.top_k < logits.numel()) {
    auto kth = std::get<0>(logits.topk(opt.top_k))[opt.top_k - 1];
    logits = logits.masked_fill(logits < kth, minus_inf);
  }
  if (opt.top_p < 1) {
    // Most likely first; a byte is kept while the mass before it is below top_p (so the first always is).
    auto [sorted, order] = torch::softmax(logits, 0).sort(/*dim=*/0, /*descending=*/true);
    const torch::Tensor before = sorted.cumsum(0) - sorted;
    const torch::Tensor drop_sorted = before >= opt.top_p;
    const torch::Tensor drop = torch::zeros_like(drop_sorted).scatter(0, order, drop_sorted);
    logits = logits.masked_fill(drop, minus_inf);
  }
  return torch::multinomial(torch::softmax(logits, 0), 1, false, generator_).item<int64_t>();
}

}  // namespace dcp
