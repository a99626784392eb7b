// Causal linear attention, the chunked form (fla's naive_chunk_linear_attn, batched over every chunk).
#include <algorithm>

#include "kernels/linear_attention/forms.h"

namespace dcp::linear_attention {

// Chunks of C tokens over the whole packed stream, all chunks batched: the stream is padded to N = ceil(T/C)
// chunks of [H, N, C, *] (padding has zero features and values, so it adds nothing). Inside a chunk the mask is
// causal and same-sequence. The state carried into chunk n belongs to the sequence of its first token and
// reaches only that sequence's leading tokens; it is the previous chunk's tail (its tokens of the sequence it
// ends with) plus, when that chunk held no other sequence, the state carried into it. Only this recursion over
// N small [H, F, Dv+1] states runs in a loop; slicing the stream per chunk instead would make backward allocate
// a stream-sized gradient per chunk, O(T^2 / C).
std::vector<torch::Tensor> chunk(const Packed& x, int64_t chunk, std::vector<torch::Tensor>* finals) {
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

}  // namespace dcp::linear_attention
