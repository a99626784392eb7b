// Grouped-query attention by expanding K/V heads to the query heads (include/dcp/attention_kernels.h).
#include <fmt/format.h>

#include <stdexcept>

#include "dcp/attention_kernels.h"

namespace dcp {

torch::Tensor expand_kv_heads(const torch::Tensor& x, int64_t heads) {
  if (!x.defined() || x.dim() != 3 || x.size(1) < 1 || heads < x.size(1) || heads % x.size(1) != 0) {
    throw std::invalid_argument(fmt::format(
        "expand_kv_heads: x must be [T, kv_heads, head_dim] with kv_heads dividing {} query heads, got {}", heads,
        x.defined() ? c10::str(x.sizes()) : std::string("undefined")));
  }
  if (x.size(1) == heads) return x;
  return x.repeat_interleave(heads / x.size(1), 1);
}

}  // namespace dcp
