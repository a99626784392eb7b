#include "dcp/infer.h"

#include <fmt/format.h>

namespace dcp {

std::string generate(Transformer& model, const std::string& prompt, const GenerateOptions& opt) {
  if (opt.max_new_tokens < 0 || opt.temperature < 0 || opt.top_k < 0 || opt.context < 1) {
    throw std::invalid_argument(fmt::format(
        "generate: max_new_tokens {}, temperature {}, top_k {} must be >= 0 and context {} >= 1",
        opt.max_new_tokens, opt.temperature, opt.top_k, opt.context));
  }
  torch::NoGradGuard no_grad;
  model->eval();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(opt.seed);
  std::vector<int64_t> tokens{kBosToken};
  for (unsigned char c : prompt) tokens.push_back(c);
  std::string out;
  for (int64_t i = 0; i < opt.max_new_tokens; ++i) {
    int64_t start = std::max<int64_t>(0, static_cast<int64_t>(tokens.size()) - opt.context);
    int64_t n = static_cast<int64_t>(tokens.size()) - start;
    PackedBatch batch;
    batch.tokens = torch::tensor(std::vector<int64_t>(tokens.begin() + start, tokens.end()), torch::kInt64);
    batch.targets = torch::zeros({n}, torch::kInt64);
    batch.positions = torch::arange(n, torch::kInt64);
    batch.cu_seqlens = torch::tensor({int64_t{0}, n}, torch::kInt64);
    torch::Tensor logits = model->forward(batch)[n - 1].slice(0, 0, 256).to(torch::kFloat64);  // bytes only
    int64_t next;
    if (opt.temperature == 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      logits = logits / opt.temperature;
      if (opt.top_k > 0 && opt.top_k < logits.numel()) {
        auto kth = std::get<0>(logits.topk(opt.top_k))[opt.top_k - 1];
        logits = logits.masked_fill(logits < kth, -std::numeric_limits<double>::infinity());
      }
      next = torch::multinomial(torch::softmax(logits, 0), 1, false, gen).item<int64_t>();
    }
    tokens.push_back(next);
    out.push_back(static_cast<char>(next));
  }
  return out;
}

}  // namespace dcp
