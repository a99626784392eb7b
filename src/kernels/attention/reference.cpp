// The reference twin of the tiled operator: whole score matrices per sample, with differentiable ATen ops.
#include <limits>

#include "dcp/attention_kernels.h"
#include "kernels/attention/varlen.h"

namespace dcp {

AttentionResult reference_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                    const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k,
                                    bool causal, double scale, bool with_lse) {
  const VarlenBounds b = check_varlen("reference_attention", q, k, v, cu_seqlens_q, cu_seqlens_k);
  const double s = attention_scale("reference_attention", scale, q.size(2));
  // bf16 is upcast so that the reference is the exact operator the tiled kernel approximates.
  const auto acc = q.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  const auto opts = q.options().dtype(acc);
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<torch::Tensor> outs, lses;
  for (int64_t i = 0; i < b.samples(); ++i) {
    const int64_t lq = b.q_len(i), lk = b.k_len(i);
    if (lq == 0) continue;
    if (lk == 0) {
      outs.push_back(torch::zeros({lq, q.size(1), q.size(2)}, q.options()));
      lses.push_back(torch::full({lq, q.size(1)}, -inf, opts));
      continue;
    }
    auto qs = q.slice(0, b.q[i], b.q[i + 1]).transpose(0, 1).to(acc);  // [H, Lq, D]
    auto ks = k.slice(0, b.k[i], b.k[i + 1]).transpose(0, 1).to(acc);  // [H, Lk, D]
    auto vs = v.slice(0, b.k[i], b.k[i + 1]).transpose(0, 1).to(acc);
    auto scores = torch::matmul(qs, ks.transpose(-2, -1)) * s;         // [H, Lq, Lk]
    // Bottom-right alignment: query r is position r + (Lk - Lq) of the key side. Queries before the first key
    // (Lq > Lk) attend nothing: their rows are zeroed before the softmax (so that neither value nor gradient
    // becomes NaN) and their probabilities after it.
    const bool any_empty = causal && lq > lk;
    torch::Tensor empty;
    if (causal) {
      auto future = torch::ones({lq, lk}, opts.dtype(torch::kBool)).triu(1 + lk - lq);
      scores = scores.masked_fill(future, -inf);
      if (any_empty) {
        empty = future.all(1).unsqueeze(1);  // [Lq, 1]
        scores = scores.masked_fill(empty, 0.0);
      }
    }
    auto probs = torch::softmax(scores, -1);
    if (any_empty) probs = probs.masked_fill(empty, 0.0);
    outs.push_back(torch::matmul(probs, vs).transpose(0, 1).to(q.scalar_type()));  // [Lq, H, D]
    if (!with_lse) continue;
    auto lse = torch::logsumexp(scores, -1);  // [H, Lq]
    if (any_empty) lse = lse.masked_fill(empty.squeeze(1), -inf);
    lses.push_back(lse.transpose(0, 1));                                             // [Lq, H]
  }
  if (outs.empty()) {
    return {torch::zeros({0, q.size(1), q.size(2)}, q.options()), torch::zeros({0, q.size(1)}, opts)};
  }
  return {torch::cat(outs, 0), with_lse ? torch::cat(lses, 0).contiguous() : torch::Tensor()};
}

}  // namespace dcp
