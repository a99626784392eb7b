// The three forms of causal linear attention behind causal_linear_attention (include/dcp/linear_attention.h),
// each in its own file beside the others: naive.cpp (the masked quadratic reference), chunk.cpp (the chunked
// scan), recurrent.cpp (the token-by-token recurrence). The denominator rides along as an extra value column
// (V' = [V, 1]), so one pass gives numerator and denominator and one state S' = [S | z] carries both.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace dcp::linear_attention {

// Every form below works on [H, T, *] views: P = phi(Q), R = phi(K), V' = [V, 1].
struct Packed {
  torch::Tensor p, r, v;
  std::vector<int64_t> bounds;
  int64_t heads, features, width;  // width = Dv + 1
};

/// The O(L^2) reference, per sequence; with `finals`, each sequence's final state [H, F, Dv+1] is appended.
/// Returns the outputs [H, L_i, Dv+1] of the non-empty sequences, in order.
std::vector<torch::Tensor> naive(const Packed& x, std::vector<torch::Tensor>* finals);
/// The chunked scan with chunks of `chunk` tokens over the whole stream; returns one [H, T, Dv+1].
std::vector<torch::Tensor> chunk(const Packed& x, int64_t chunk, std::vector<torch::Tensor>* finals);
/// Token by token from `initial` ([n_seq, H, F, Dv+1], undefined: zero); returns one [H, 1, Dv+1] per token.
std::vector<torch::Tensor> recurrent(const Packed& x, const torch::Tensor& initial,
                                     std::vector<torch::Tensor>* finals);

}  // namespace dcp::linear_attention
