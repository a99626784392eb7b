// Linear weights in the compute dtype, kept between the steps of decoding (DecodeSession, dcp serve, dcp generate):
// a bf16 model keeps fp32 master weights and casts them to bf16 at every linear layer's call (training needs the
// cast inside autograd, so that gradients reach the fp32 weights); a decode step of a few tokens then spends more
// time casting the weights than multiplying by them.
#pragma once

#include <torch/torch.h>

#include <initializer_list>

namespace dcp {

/// While one is alive on a thread, weights_in on that thread may return a cast it made earlier instead of casting
/// again, when gradient mode is off (torch::NoGradGuard). Nests. DecodeSession holds one for each step.
class CastWeightsScope {
 public:
  CastWeightsScope();
  ~CastWeightsScope();
  CastWeightsScope(const CastWeightsScope&) = delete;
  CastWeightsScope& operator=(const CastWeightsScope&) = delete;
};

/// The weight `parts` concatenated along dim 0 (one part: itself), in `dtype`: what
/// torch::cat(parts).to(dtype) returns, to the bit (the cast is round-to-nearest-even either way). Inside a
/// CastWeightsScope with gradient mode off, the result is kept, keyed by the parts, and returned again while every
/// part is the same live tensor with the same data pointer and version counter (every in-place change, an optimizer
/// step or a checkpoint load, bumps the counter; a write to the memory that bypasses it would not be seen, which is
/// why only decoding opens the scope). Elsewhere it casts every time, inside autograd. A kept cast holds memory
/// (for an fp32 model, the concatenated gate and up weights once more); one whose weight died is released at the
/// next weights_in that makes a cast, or at kept_weight_casts. Thread-safe. Throws what torch::cat / Tensor::to
/// throw (parts of other widths or devices).
torch::Tensor weights_in(std::initializer_list<torch::Tensor> parts, torch::ScalarType dtype);

/// Releases the casts whose weights died and returns how many it keeps; for tests.
size_t kept_weight_casts();

}  // namespace dcp
