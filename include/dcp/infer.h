// Text generation from a trained byte-level model.
#pragma once

#include <cstdint>
#include <string>

#include "dcp/model.h"

namespace dcp {

struct GenerateOptions {
  int64_t max_new_tokens = 200;
  double temperature = 1.0;   ///< 0 = greedy
  int64_t top_k = 0;          ///< 0 = no top-k filtering
  uint64_t seed = 0;
  int64_t context = 1024;     ///< tokens the model sees (the training max_seq_len)
};

/// Samples `max_new_tokens` bytes after BOS + `prompt` and returns them (raw bytes; may be invalid UTF-8 where
/// the model emits it). Softmax models recompute the window each token (no KV cache); flexformer models decode
/// recurrently from per-layer states (FlexformerDecoding), rebuilt only when the window slides. Throws
/// std::invalid_argument for a negative max_new_tokens or temperature, or a negative top_k.
std::string generate(Transformer& model, const std::string& prompt, const GenerateOptions& opt);

}  // namespace dcp
