// Causal linear attention over a packed stream in three forms: quadratic reference, chunked scan, recurrence.
// The denominator rides along as an extra value column (V' = [V, 1]), so one pass gives numerator and
// denominator and one state S' = [S | z] carries both.
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "dcp/flexformer.h"

namespace dcp {
namespace {

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

// Every form below works on [H, T, *] views: P = phi(Q), R = phi(K), V' = [V, 1].
struct Packed {
  torch::Tensor p, r, v;
  std::vector<int64_t> bounds;
  int64_t heads, features, width;  // width = Dv + 1
};

// The O(L^2) reference: A = (P R^T) masked causally, sequence by sequence, so nothing crosses a boundary.
std::vector<torch::Tensor> quadratic(const Packed& x, std::vector<torch::Tensor>* finals) {
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

// Chunks of C tokens over the whole packed stream, all chunks batched: the stream is padded to N = ceil(T/C)
// chunks of [H, N, C, *] (padding has zero features and values, so it adds nothing). Inside a chunk the mask is
// causal and same-sequence. The state carried into chunk n belongs to the sequence of its first token and
// reaches only that sequence's leading tokens; it is the previous chunk's tail (its tokens of the sequence it
// ends with) plus, when that chunk held no other sequence, the state carried into it. Only this recursion over
// N small [H, F, Dv+1] states runs in a loop; slicing the stream per chunk instead would make backward allocate
// a stream-sized gradient per chunk, O(T^2 / C).
std::vector<torch::Tensor> chunked(const Packed& x, int64_t chunk, std::vector<torch::Tensor>* finals) {
  const int64_t total = x.p.size(1);
  chunk = std::min(chunk, std::max<int64_t>(total, 1));  // a chunk past the stream is all padding, C^2 of it
  const int64_t n_seq = static_cast<int64_t>(x.bounds.size()) - 1;
  const int64_t n_chunks = (total + chunk - 1) / chunk, padded = n_chunks * chunk;
  std::vector<int64_t> seq_of(static_cast<size_t>(padded), -1);
  for (int64_t i = 0; i < n_seq; ++i) {
    std::fill(seq_of.begin() + x.bounds[i], seq_of.begin() + x.bounds[i + 1], i);
  }
  auto blocks = [&](const torch::Tensor& t) {  // [H, T, *] -> [H, N, C, *]
    auto padded_t = torch::constant_pad_nd(t, {0, 0, 0, padded - total});
    return padded_t.view({x.heads, n_chunks, chunk, t.size(2)});
  };
  const auto p = blocks(x.p), r = blocks(x.r), v = blocks(x.v);
  const auto ids = torch::tensor(seq_of, torch::kInt64).to(x.p.device()).view({n_chunks, chunk});
  const auto causal = torch::ones({chunk, chunk}, ids.options().dtype(torch::kBool)).tril();
  const auto mask = (ids.unsqueeze(2) == ids.unsqueeze(1)) & causal;  // [N, C, C]
  auto out = torch::matmul(torch::matmul(p, r.transpose(-1, -2)) * mask, v);  // [H, N, C, Dv+1]

  if (n_chunks > 1) {
    std::vector<int64_t> first(static_cast<size_t>(n_chunks)), last(static_cast<size_t>(n_chunks));
    for (int64_t n = 0; n < n_chunks; ++n) {
      first[n] = seq_of[static_cast<size_t>(n * chunk)];
      last[n] = seq_of[static_cast<size_t>(std::min((n + 1) * chunk, total) - 1)];
    }
    const auto last_ids = torch::tensor(last, torch::kInt64).to(x.p.device());
    const auto in_tail = (ids == last_ids.unsqueeze(1)).to(x.r.scalar_type()).unsqueeze(-1);  // [N, C, 1]
    const auto tails = torch::matmul((r * in_tail).transpose(-1, -2), v).unbind(1);  // N x [H, F, Dv+1]
    const auto zero = torch::zeros({x.heads, x.features, x.width}, x.p.options());
    std::vector<torch::Tensor> carried{zero};
    for (int64_t n = 1; n < n_chunks; ++n) {
      if (last[n - 1] != first[n]) {
        carried.push_back(zero);
      } else {
        carried.push_back(first[n - 1] == last[n - 1] ? carried.back() + tails[n - 1] : tails[n - 1]);
      }
    }
    const auto first_ids = torch::tensor(first, torch::kInt64).to(x.p.device());
    const auto leading = (ids == first_ids.unsqueeze(1)).to(x.p.scalar_type()).unsqueeze(-1);  // [N, C, 1]
    out = out + torch::matmul(p, torch::stack(carried, 1)) * leading;
  }
  if (finals) {
    for (int64_t i = 0; i < n_seq; ++i) {
      const int64_t a = x.bounds[i], b = x.bounds[i + 1];
      finals->push_back(torch::matmul(x.r.slice(1, a, b).transpose(1, 2), x.v.slice(1, a, b)));  // [H, F, Dv+1]
    }
  }
  return {out.view({x.heads, padded, x.width}).slice(1, 0, total)};
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
    case LinearAttentionForm::kQuadratic: outs = quadratic(x, finals_out); break;
    case LinearAttentionForm::kChunk: outs = chunked(x, chunk_size, finals_out); break;
    case LinearAttentionForm::kRecurrent: outs = recurrent(x, init, finals_out); break;
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
