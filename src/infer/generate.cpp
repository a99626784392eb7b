#include <fmt/format.h>

#include "dcp/infer.h"

namespace dcp {

std::string generate(Transformer& model, const std::string& prompt, const GenerateOptions& opt) {
  if (opt.max_new_tokens < 0 || opt.temperature < 0 || opt.top_k < 0 || opt.context < 1 || opt.chunk_tokens < 1 ||
      opt.chunk_pairs < 0 ||
      !(opt.top_p > 0 && opt.top_p <= 1)) {
    throw std::invalid_argument(fmt::format(
        "generate: max_new_tokens {}, temperature {}, top_k {} and chunk_pairs {} must be >= 0, top_p {} in (0, 1], "
        "context {} and chunk_tokens {} >= 1",
        opt.max_new_tokens, opt.temperature, opt.top_k, opt.chunk_pairs, opt.top_p, opt.context, opt.chunk_tokens));
  }
  torch::NoGradGuard no_grad;
  model->eval();
  ByteSampler sampler(opt.seed);
  std::vector<int64_t> tokens{kBosToken};
  for (unsigned char c : prompt) tokens.push_back(c);
  // Both decoders run only the tokens not yet seen: a softmax model from its KV cache, a flexformer model from
  // each layer's carried state. When the window slides, positions restart at 0, so cache or states are rebuilt
  // from the new window's tokens: the same logits as recomputing the window, cheap per token until then.
  std::unique_ptr<RecurrentSession> recurrent;
  std::unique_ptr<DecodeSession> session;
  if (decodes_recurrently(model)) {
    if (opt.kv_policy) {
      throw std::invalid_argument("generate: a KV cache policy needs softmax attention (this model is flexformer)");
    }
    recurrent = std::make_unique<RecurrentSession>(model, opt.chunk_tokens);
  } else {
    session = std::make_unique<DecodeSession>(model, opt.chunk_tokens, opt.kv_policy, opt.chunk_pairs);
  }
  int64_t cached_start = -1;  // the window start the cache or states were built for
  // Logits [kVocabSize] after tokens[start..end): from the cache or states where they cover tokens[start..end-1).
  auto next_logits = [&](int64_t start) -> torch::Tensor {
    const bool rebuild = start != cached_start;
    cached_start = start;
    if (rebuild) {
      const std::vector<int64_t> window(tokens.begin() + start, tokens.end());
      if (session) {
        session->reset();
        return session->prefill(window).select(0, -1);
      }
      recurrent->reset();
      return recurrent->prefill(window).select(0, -1);
    }
    return session ? session->decode(tokens.back()) : recurrent->decode(tokens.back());
  };
  std::string out;
  const SamplingOptions sampling{opt.temperature, opt.top_k, opt.top_p};
  for (int64_t i = 0; i < opt.max_new_tokens; ++i) {
    int64_t start = std::max<int64_t>(0, static_cast<int64_t>(tokens.size()) - opt.context);
    const int64_t next = sampler.next(next_logits(start), sampling, i);
    tokens.push_back(next);
    out.push_back(static_cast<char>(next));
    if (opt.on_byte) opt.on_byte(static_cast<char>(next));
  }
  return out;
}

}  // namespace dcp
