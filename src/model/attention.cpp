// make_attention_backend: the backend attention.backend names, one per layer (include/dcp/model.h).
#include <stdexcept>
#include <string>

#include "dcp/flexformer.h"
#include "dcp/model.h"

namespace dcp {

std::shared_ptr<AttentionBackend> make_attention_backend(const AttentionConfig& cfg, const ModelConfig& model) {
  if (cfg.backend == "softmax") {
    AttentionOptions options;
    options.tile_q = cfg.tile_q;
    options.tile_k = cfg.tile_k;
    return std::make_shared<SoftmaxAttention>(
        cfg.impl == "reference" ? SoftmaxAttention::Impl::reference : SoftmaxAttention::Impl::tiled, options);
  }
  if (cfg.backend == "flexformer") {
    if (model.kv_heads() != model.n_heads) {
      throw std::invalid_argument("attention: backend flexformer needs as many K/V heads as query heads (n_kv_heads " +
                                  std::to_string(model.n_kv_heads) + ", n_heads " + std::to_string(model.n_heads) +
                                  "); grouped-query attention is softmax only");
    }
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
