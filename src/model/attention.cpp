#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "dcp/flexformer.h"
#include "dcp/model.h"

namespace dcp {

torch::Tensor SoftmaxAttention::forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        const torch::Tensor& cu_seqlens) const {
  // Sample boundaries drive host-side slicing, so read them on the CPU whatever device q lives on.
  const torch::Tensor cu = cu_seqlens.to(torch::kCPU, torch::kInt64).contiguous();
  const int64_t* bounds = cu.data_ptr<int64_t>();
  const int64_t n = cu.numel() - 1;
  if (n < 1 || bounds[0] != 0 || bounds[n] != q.size(0)) {
    throw std::invalid_argument("SoftmaxAttention: cu_seqlens must run from 0 to " + std::to_string(q.size(0)));
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(2)));
  std::vector<torch::Tensor> outputs;
  outputs.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t start = bounds[i], end = bounds[i + 1], len = end - start;
    auto qs = q.slice(0, start, end).transpose(0, 1);  // [H, L, D]
    auto ks = k.slice(0, start, end).transpose(0, 1);
    auto vs = v.slice(0, start, end).transpose(0, 1);
    auto scores = torch::matmul(qs, ks.transpose(-2, -1)) * scale;  // [H, L, L]
    auto future = torch::ones({len, len}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
    // Softmax in fp32 so that reduced-precision inputs do not lose the normaliser.
    auto probs = torch::softmax(scores, -1, torch::kFloat).to(v.scalar_type());
    outputs.push_back(torch::matmul(probs, vs).transpose(0, 1));  // [L, H, D]
  }
  return torch::cat(outputs, 0);
}

std::shared_ptr<AttentionBackend> make_attention_backend(const AttentionConfig& cfg, const ModelConfig& model) {
  if (cfg.backend == "softmax") return std::make_shared<SoftmaxAttention>();
  if (cfg.backend == "flexformer") {
    if (model.n_heads <= 0 || model.d_model % model.n_heads != 0) {
      throw std::invalid_argument("attention: d_model " + std::to_string(model.d_model) +
                                  " is not divisible by n_heads " + std::to_string(model.n_heads));
    }
    return std::make_shared<FlexformerAttention>(FlexformerOptions::from_config(cfg), model.n_heads,
                                                 model.d_model / model.n_heads);
  }
  throw ConfigError("config key 'attention.backend': bad value '" + cfg.backend + "' (allowed: softmax, flexformer)");
}

}  // namespace dcp
