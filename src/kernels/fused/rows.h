// What the fused elementwise kernels share: the checks of their inputs and a parallel loop over rows.
#pragma once

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <string>

namespace dcp::fused {

/// Throws std::invalid_argument unless t is a defined tensor of fp32 or bf16 whose last dimension is contiguous;
/// `who` and `name` prefix the message.
void check_rows(const std::string& who, const char* name, const torch::Tensor& t);

/// True when the fused kernel can run on t: a CPU tensor on a CPU with AVX-512 (else the plain twin runs).
bool fused_path(const torch::Tensor& t);

/// fn(row_begin, row_end) over [0, rows) in chunks of about 32 KB of work (`row_bytes` per row).
template <class Fn>
void for_rows(int64_t rows, int64_t row_bytes, Fn fn) {
  const int64_t grain = std::max<int64_t>(1, (32 << 10) / std::max<int64_t>(1, row_bytes));
  at::parallel_for(0, rows, grain, fn);
}

/// Calls fn(T{}) with T = float or c10::BFloat16 for `dtype` (checked by check_rows).
template <class Fn>
void with_dtype(torch::ScalarType dtype, Fn fn) {
  if (dtype == torch::kFloat) return fn(float{});
  fn(c10::BFloat16{});
}

}  // namespace dcp::fused
