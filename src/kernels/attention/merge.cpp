// Exact combination of attention over two disjoint key sets (the (out, lse) form).
#include <fmt/format.h>

#include <limits>
#include <stdexcept>

#include "dcp/attention_kernels.h"

namespace dcp {

AttentionResult merge_attention(const AttentionResult& a, const AttentionResult& b) {
  if (a.out.sizes() != b.out.sizes() || a.lse.sizes() != b.lse.sizes() || a.out.dim() != 3 ||
      a.lse.sizes() != a.out.sizes().slice(0, 2)) {
    throw std::invalid_argument(fmt::format("merge_attention: out {} / {} and lse {} / {} do not match",
                                            c10::str(a.out.sizes()), c10::str(b.out.sizes()), c10::str(a.lse.sizes()), c10::str(b.lse.sizes())));
  }
  const double inf = std::numeric_limits<double>::infinity();
  auto lse = torch::logaddexp(a.lse, b.lse);
  // Where both parts are empty lse is -inf; a reference point of 0 keeps the weights exp(-inf) = 0, not NaN.
  auto ref = lse.masked_fill(lse == -inf, 0.0);
  auto wa = torch::exp(a.lse - ref).unsqueeze(-1);
  auto wb = torch::exp(b.lse - ref).unsqueeze(-1);
  auto out = a.out.to(lse.scalar_type()) * wa + b.out.to(lse.scalar_type()) * wb;
  return {out.to(a.out.scalar_type()), lse};
}

}  // namespace dcp
