#include "kernels/fused/rows.h"

#include <fmt/format.h>

#include <stdexcept>

#include "dcp/cpu_features.h"

namespace dcp::fused {

void check_rows(const std::string& who, const char* name, const torch::Tensor& t) {
  if (!t.defined() || t.dim() < 1) throw std::invalid_argument(fmt::format("{}: {} must be a tensor", who, name));
  if (t.scalar_type() != torch::kFloat && t.scalar_type() != torch::kBFloat16) {
    throw std::invalid_argument(fmt::format("{}: {} has dtype {} (allowed: fp32, bf16)", who, name,
                                            c10::toString(t.scalar_type())));
  }
  if (t.size(-1) > 1 && t.stride(-1) != 1) {
    throw std::invalid_argument(fmt::format("{}: {} must be contiguous in its last dimension (stride {})", who,
                                            name, t.stride(-1)));
  }
}

bool fused_path(const torch::Tensor& t) { return t.device().is_cpu() && avx512_usable(); }

}  // namespace dcp::fused
