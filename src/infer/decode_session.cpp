// Chunked prefill and token-by-token decoding of one sequence through its KV cache.
#include <fmt/format.h>

#include <stdexcept>

#include "dcp/infer.h"

namespace dcp {

DecodeSession::DecodeSession(Transformer model, int64_t chunk_tokens, std::shared_ptr<KvPolicy> policy)
    : model_(std::move(model)),
      chunk_tokens_(chunk_tokens),
      policy_(policy ? std::move(policy) : std::make_shared<FullKvPolicy>()) {
  if (chunk_tokens < 1) {
    throw std::invalid_argument(fmt::format("DecodeSession: chunk_tokens {} must be >= 1", chunk_tokens));
  }
  for (int64_t i = 0; i < model_->cfg.n_layers; ++i) {
    if (dynamic_cast<const SoftmaxAttention*>(model_->blocks->ptr<BlockImpl>(static_cast<size_t>(i))->attention.get()) ==
        nullptr) {
      throw std::invalid_argument(fmt::format(
          "DecodeSession: layer {} does not use softmax attention; a KV cache needs attention.backend: softmax "
          "(flexformer models decode recurrently with FlexformerDecoding)", i));
    }
  }
  cache_ = std::make_shared<KvCache>(kv_cache_spec(model_));
  const KvObservationNeeds needs = policy_->needs();
  if (needs.any()) {
    observations_ = std::make_shared<KvObservations>(cache_->spec().layers, cache_->spec().kv_heads, needs,
                                                     model_->cfg.n_heads, model_->cfg.rope_theta);
  }
}

void DecodeSession::reset() {
  cache_->clear();
  if (observations_) observations_->clear();
  policy_->reset();
}

torch::Tensor DecodeSession::prefill(const std::vector<int64_t>& tokens) { return run(tokens, /*prefill=*/true); }

torch::Tensor DecodeSession::decode(int64_t token) { return run({token}, /*prefill=*/false)[0]; }

torch::Tensor DecodeSession::run(const std::vector<int64_t>& tokens, bool prefill) {
  if (tokens.empty()) throw std::invalid_argument("DecodeSession: no tokens to run");
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= kVocabSize) {
      throw std::invalid_argument(fmt::format("DecodeSession: token {} at index {} outside [0, {})", tokens[i], i,
                                              kVocabSize));
    }
  }
  torch::NoGradGuard no_grad;
  const int64_t total = static_cast<int64_t>(tokens.size());
  // A prompt's chunks then copy nothing (else storage would double about log2(prompt) times); one decoded token
  // leaves doubling to append.
  if (total > 1) cache_->reserve(total);
  std::vector<torch::Tensor> logits;
  for (int64_t s = 0; s < total; s += chunk_tokens_) {
    const int64_t t = std::min(chunk_tokens_, total - s);
    const int64_t first = cache_->next_position();
    PackedBatch batch;
    batch.tokens = torch::tensor(std::vector<int64_t>(tokens.begin() + s, tokens.begin() + s + t), torch::kInt64);
    batch.targets = torch::zeros({t}, torch::kInt64);
    batch.positions = torch::arange(first, first + t, torch::kInt64);
    batch.cu_seqlens = torch::tensor({int64_t{0}, t}, torch::kInt64);
    batch.attention = std::make_shared<KvCacheAttention>(cache_, batch.positions, observations_);
    logits.push_back(model_->forward(batch));
    policy_->after_step(*cache_, KvStep{prefill, first, t, observations_.get()});
  }
  return logits.size() == 1 ? logits[0] : torch::cat(logits);
}

}  // namespace dcp
