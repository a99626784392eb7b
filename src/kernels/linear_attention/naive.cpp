// Causal linear attention, the naive form: the masked quadratic reference twin of chunk.cpp and recurrent.cpp.
#include "kernels/linear_attention/forms.h"

namespace dcp::linear_attention {

// The O(L^2) reference: A = (P R^T) masked causally, sequence by sequence, so nothing crosses a boundary.
std::vector<torch::Tensor> naive(const Packed& x, std::vector<torch::Tensor>* finals) {
  std::vector<torch::Tensor> outs;
  for (size_t i = 0; i + 1 < x.bounds.size(); ++i) {
    const int64_t a = x.bounds[i], b = x.bounds[i + 1];
    auto p = x.p.slice(1, a, b), r = x.r.slice(1, a, b), v = x.v.slice(1, a, b);
    if (finals) finals->push_back(torch::matmul(r.transpose(1, 2), v));  // [H, F, Dv+1]
    if (b == a) continue;
    auto causal = torch::ones({b - a, b - a}, x.p.options().dtype(torch::kBool)).tril();
    auto scores = torch::matmul(p, r.transpose(1, 2)) * causal;  // [H, L, L]; masked after the feature map
    outs.push_back(torch::matmul(scores, v));
  }
  return outs;
}

}  // namespace dcp::linear_attention
