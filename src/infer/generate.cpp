#include "dcp/infer.h"

#include <fmt/format.h>

#include "dcp/flexformer.h"

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
  // A flexformer model decodes recurrently: only the tokens not yet seen run, from each layer's carried state.
  // When the window slides, positions restart at 0, so the state is rebuilt from the new window's tokens:
  // the same logits as recomputing the window, at O(1) per token until then.
  std::shared_ptr<FlexformerDecoding> decoding;
  if (model->cfg.n_layers > 0 &&
      dynamic_cast<const FlexformerAttention*>(model->blocks->ptr<BlockImpl>(0)->attention.get()) != nullptr) {
    decoding = std::make_shared<FlexformerDecoding>(model->cfg.n_layers);
  }
  int64_t cached_start = -1, cached = 0;  // window start the states were built for, and tokens they cover
  std::string out;
  for (int64_t i = 0; i < opt.max_new_tokens; ++i) {
    int64_t start = std::max<int64_t>(0, static_cast<int64_t>(tokens.size()) - opt.context);
    int64_t first = 0;  // position (inside the window) of the first token to run
    if (decoding) {
      if (start != cached_start) {
        decoding->reset();
        cached_start = start;
        cached = 0;
      }
      first = cached;
    }
    int64_t n = static_cast<int64_t>(tokens.size()) - start - first;
    PackedBatch batch;
    batch.tokens = torch::tensor(std::vector<int64_t>(tokens.begin() + start + first, tokens.end()), torch::kInt64);
    batch.targets = torch::zeros({n}, torch::kInt64);
    batch.positions = torch::arange(first, first + n, torch::kInt64);
    batch.cu_seqlens = torch::tensor({int64_t{0}, n}, torch::kInt64);
    batch.attention = decoding;
    if (decoding) cached = first + n;
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
