// Test helpers of the KV-cache tests: a tiny random model with peaked attention, random token sequences, and
// a session's logits over a whole sequence.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dcp/config.h"
#include "dcp/data.h"
#include "dcp/infer.h"
#include "dcp/model.h"

namespace dcp::test {

/// d_model 64, 4 heads (head_dim 16), d_ff 128, `layers` layers.
inline ModelConfig kv_tiny_config(int64_t layers = 3) {
  ModelConfig cfg;
  cfg.d_model = 64;
  cfg.n_layers = layers;
  cfg.n_heads = 4;
  cfg.d_ff = 128;
  return cfg;
}

/// A random model whose attention is peaked, in eval mode. At init (std 0.02) scores are ~0.1 and every head
/// averages its whole context, which would hide a wrong mask, position or evicted entry; scaling the q and k
/// rows of wqkv by 8 makes scores O(5).
/// kv_heads < 4: grouped-query attention (the q and k rows scaled are then d_model + kv_heads x head_dim).
inline Transformer sharp_model(uint64_t seed, Precision precision = Precision::kFp32, int64_t layers = 3,
                               int64_t kv_heads = 0) {
  torch::manual_seed(seed);
  ModelConfig cfg = kv_tiny_config(layers);
  cfg.n_kv_heads = kv_heads;
  Transformer model(cfg, AttentionConfig{}, precision);
  torch::NoGradGuard no_grad;
  const int64_t qk_rows = cfg.d_model + cfg.kv_heads() * (cfg.d_model / cfg.n_heads);
  for (const auto& item : model->named_parameters()) {
    if (item.key().find("wqkv") != std::string::npos) item.value().narrow(0, 0, qk_rows).mul_(8.0);
  }
  model->eval();
  return model;
}

/// BOS, then n - 1 random bytes.
inline std::vector<int64_t> random_tokens(int64_t n, uint64_t seed) {
  torch::manual_seed(seed);
  auto t = torch::randint(0, 256, {n}, torch::kInt64);
  std::vector<int64_t> out(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + n);
  out[0] = kBosToken;
  return out;
}

/// The whole sequence through model->forward: row i = logits after tokens[0..i], positions 0..n-1, [n, vocab].
inline torch::Tensor full_forward(Transformer& model, const std::vector<int64_t>& tokens) {
  torch::NoGradGuard no_grad;
  const auto n = static_cast<int64_t>(tokens.size());
  PackedBatch b;
  b.tokens = torch::tensor(tokens, torch::kInt64);
  b.targets = torch::zeros({n}, torch::kInt64);
  b.positions = torch::arange(n, torch::kInt64);
  b.cu_seqlens = torch::tensor({int64_t{0}, n}, torch::kInt64);
  return model->forward(b);
}

/// The first `prompt` tokens prefilled in chunks of 16, the rest decoded one at a time: logits [n, vocab].
inline torch::Tensor session_logits(Transformer& model, const std::vector<int64_t>& tokens, int64_t prompt,
                                    std::shared_ptr<KvPolicy> policy) {
  DecodeSession session(model, 16, std::move(policy));
  std::vector<torch::Tensor> rows{session.prefill(std::vector<int64_t>(tokens.begin(), tokens.begin() + prompt))};
  for (size_t i = static_cast<size_t>(prompt); i < tokens.size(); ++i) {
    rows.push_back(session.decode(tokens[i]).unsqueeze(0));
  }
  return torch::cat(rows);
}

}  // namespace dcp::test
