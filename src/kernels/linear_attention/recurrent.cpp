// Causal linear attention, the recurrent form: one state update per token, as in decoding.
#include "kernels/linear_attention/forms.h"

namespace dcp::linear_attention {

// Token by token: S_t = S_{t-1} + r_t v_t^T, out_t = p_t^T S_t, reset (to the initial state) at each boundary.
std::vector<torch::Tensor> recurrent(const Packed& x, const torch::Tensor& initial,
                                     std::vector<torch::Tensor>* finals) {
  std::vector<torch::Tensor> outs;
  for (size_t i = 0; i + 1 < x.bounds.size(); ++i) {
    torch::Tensor state = initial.defined() ? initial[static_cast<int64_t>(i)]
                                            : torch::zeros({x.heads, x.features, x.width}, x.p.options());
    for (int64_t t = x.bounds[i]; t < x.bounds[i + 1]; ++t) {
      auto r = x.r.select(1, t), v = x.v.select(1, t), p = x.p.select(1, t);  // [H, F], [H, Dv+1], [H, F]
      state = state + r.unsqueeze(-1) * v.unsqueeze(-2);
      outs.push_back(torch::matmul(p.unsqueeze(-2), state));  // [H, 1, Dv+1]
    }
    if (finals) finals->push_back(state);
  }
  return outs;
}

}  // namespace dcp::linear_attention
