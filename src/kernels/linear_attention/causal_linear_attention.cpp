// causal_linear_attention: checks its arguments, packs [H, T, *] views and runs one of the three forms
// (kernels/linear_attention/forms.h).
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "dcp/linear_attention.h"
#include "kernels/linear_attention/forms.h"

namespace dcp {
namespace {

using linear_attention::Packed;

std::string shape_of(const torch::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

// Host copy of cu_seqlens, checked to run non-decreasing from 0 to `total`.
std::vector<int64_t> host_bounds(const torch::Tensor& cu_seqlens, int64_t total) {
  if (!cu_seqlens.defined() || cu_seqlens.dim() != 1 || cu_seqlens.numel() < 2) {
    throw std::invalid_argument("causal_linear_attention: cu_seqlens must be 1-D with at least 2 entries, got " +
                                (cu_seqlens.defined() ? shape_of(cu_seqlens) : std::string("undefined")));
  }
  const torch::Tensor cu = cu_seqlens.to(torch::kCPU, torch::kInt64).contiguous();
  std::vector<int64_t> b(cu.data_ptr<int64_t>(), cu.data_ptr<int64_t>() + cu.numel());
  bool ok = b.front() == 0 && b.back() == total;
  for (size_t i = 1; i < b.size(); ++i) ok = ok && b[i] >= b[i - 1];
  if (!ok) {
    throw std::invalid_argument("causal_linear_attention: cu_seqlens must run non-decreasing from 0 to T = " +
                                std::to_string(total));
  }
  return b;
}

// S' = [S | z]: [n_seq, H, F, Dv + 1].
torch::Tensor fold_state(const LinearAttentionState& st) { return torch::cat({st.s, st.z.unsqueeze(-1)}, -1); }

LinearAttentionState unfold_state(const torch::Tensor& folded) {
  const int64_t dv = folded.size(-1) - 1;
  return {folded.narrow(-1, 0, dv), folded.select(-1, dv)};
}

void check_initial(const LinearAttentionState& st, int64_t n_seq, int64_t heads, int64_t features, int64_t dv,
                   const torch::Tensor& like) {
  const std::vector<int64_t> want_s{n_seq, heads, features, dv}, want_z{n_seq, heads, features};
  if (!st.s.defined() || !st.z.defined() || st.s.sizes() != c10::IntArrayRef(want_s) ||
      st.z.sizes() != c10::IntArrayRef(want_z)) {
    throw std::invalid_argument("causal_linear_attention: initial state must be s [" + std::to_string(n_seq) + ", " +
                                std::to_string(heads) + ", " + std::to_string(features) + ", " + std::to_string(dv) +
                                "] and z [" + std::to_string(n_seq) + ", " + std::to_string(heads) + ", " +
                                std::to_string(features) + "], got s " +
                                (st.s.defined() ? shape_of(st.s) : "undefined") + " and z " +
                                (st.z.defined() ? shape_of(st.z) : "undefined"));
  }
  if (st.s.scalar_type() != like.scalar_type() || st.z.scalar_type() != like.scalar_type()) {
    throw std::invalid_argument("causal_linear_attention: initial state dtype differs from the features' dtype");
  }
}

}  // namespace

LinearAttentionOutput causal_linear_attention(const torch::Tensor& phi_q, const torch::Tensor& phi_k,
                                              const torch::Tensor& v, const torch::Tensor& cu_seqlens,
                                              LinearAttentionForm form, int64_t chunk_size,
                                              const LinearAttentionState* initial, bool return_final_state) {
  if (phi_q.dim() != 3 || phi_k.sizes() != phi_q.sizes() || v.dim() != 3 || v.size(0) != phi_q.size(0) ||
      v.size(1) != phi_q.size(1)) {
    throw std::invalid_argument("causal_linear_attention: phi_q and phi_k must be [T, heads, F] and v [T, heads, Dv], "
                                "got phi_q " + shape_of(phi_q) + ", phi_k " + shape_of(phi_k) + ", v " + shape_of(v));
  }
  const auto dtype = phi_q.scalar_type();
  if ((dtype != torch::kFloat && dtype != torch::kDouble) || phi_k.scalar_type() != dtype ||
      v.scalar_type() != dtype) {
    throw std::invalid_argument("causal_linear_attention: phi_q, phi_k and v must share dtype float32 or float64");
  }
  if (chunk_size < 1) {
    throw std::invalid_argument("causal_linear_attention: chunk_size must be >= 1, got " + std::to_string(chunk_size));
  }
  const int64_t total = phi_q.size(0), heads = phi_q.size(1), features = phi_q.size(2), dv = v.size(2);
  Packed x;
  x.bounds = host_bounds(cu_seqlens, total);
  const int64_t n_seq = static_cast<int64_t>(x.bounds.size()) - 1;
  x.heads = heads;
  x.features = features;
  x.width = dv + 1;
  x.p = phi_q.transpose(0, 1);
  x.r = phi_k.transpose(0, 1);
  x.v = torch::cat({v, torch::ones({total, heads, 1}, v.options())}, -1).transpose(0, 1);  // [H, T, Dv+1]
  torch::Tensor init;
  if (initial) {
    check_initial(*initial, n_seq, heads, features, dv, phi_q);
    init = fold_state(*initial);
  }

  std::vector<torch::Tensor> finals;
  std::vector<torch::Tensor>* finals_out = return_final_state ? &finals : nullptr;
  std::vector<torch::Tensor> outs;
  switch (form) {
    case LinearAttentionForm::kQuadratic: outs = linear_attention::naive(x, finals_out); break;
    case LinearAttentionForm::kChunk: outs = linear_attention::chunk(x, chunk_size, finals_out); break;
    case LinearAttentionForm::kRecurrent: outs = linear_attention::recurrent(x, init, finals_out); break;
  }
  torch::Tensor out = outs.empty() ? torch::zeros({heads, 0, x.width}, x.p.options()) : torch::cat(outs, 1);
  if (init.defined() && form != LinearAttentionForm::kRecurrent) {
    // Linear in the state: the initial state's share p_t^T S0 is added per sequence, and to the final states.
    std::vector<torch::Tensor> shares;
    for (int64_t i = 0; i < n_seq; ++i) {
      const int64_t a = x.bounds[i], b = x.bounds[i + 1];
      if (b > a) shares.push_back(torch::matmul(x.p.slice(1, a, b), init[i]));
    }
    if (!shares.empty()) out = out + torch::cat(shares, 1);
    for (int64_t i = 0; i < static_cast<int64_t>(finals.size()); ++i) finals[i] = finals[i] + init[i];
  }
  out = out.transpose(0, 1);  // [T, H, Dv+1]
  LinearAttentionOutput result;
  result.numerator = out.narrow(-1, 0, dv);
  result.denominator = out.select(-1, dv);
  if (return_final_state) result.final_state = unfold_state(torch::stack(finals, 0));
  return result;
}

}  // namespace dcp
