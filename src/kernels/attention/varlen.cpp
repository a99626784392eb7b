#include "kernels/attention/varlen.h"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>

namespace dcp {
namespace {

std::vector<int64_t> host_bounds(const std::string& who, const char* name, const torch::Tensor& cu, int64_t total) {
  if (!cu.defined() || cu.dim() != 1 || cu.numel() < 2) {
    throw std::invalid_argument(fmt::format("{}: {} must be a 1-D tensor of at least 2 offsets", who, name));
  }
  const torch::Tensor host = cu.to(torch::kCPU, torch::kInt64).contiguous();
  const int64_t* p = host.data_ptr<int64_t>();
  std::vector<int64_t> bounds(p, p + host.numel());
  if (bounds.front() != 0 || bounds.back() != total) {
    throw std::invalid_argument(fmt::format("{}: {} must run from 0 to {} (got {} .. {})", who, name, total,
                                            bounds.front(), bounds.back()));
  }
  for (size_t i = 1; i < bounds.size(); ++i) {
    if (bounds[i] < bounds[i - 1]) {
      throw std::invalid_argument(fmt::format("{}: {} decreases at index {} ({} after {})", who, name, i, bounds[i],
                                              bounds[i - 1]));
    }
  }
  return bounds;
}

}  // namespace

VarlenBounds check_varlen(const std::string& who, const torch::Tensor& q, const torch::Tensor& k,
                          const torch::Tensor& v, const torch::Tensor& cu_seqlens_q,
                          const torch::Tensor& cu_seqlens_k) {
  for (const auto& [name, t] : {std::pair{"q", &q}, std::pair{"k", &k}, std::pair{"v", &v}}) {
    if (!t->defined() || t->dim() != 3) {
      throw std::invalid_argument(fmt::format("{}: {} must be [tokens, heads, head_dim]", who, name));
    }
    if (t->stride(2) != 1 && t->size(2) > 1) {
      throw std::invalid_argument(fmt::format("{}: {} must be contiguous in head_dim (stride {})", who, name,
                                              t->stride(2)));
    }
  }
  if (k.sizes() != v.sizes()) {
    throw std::invalid_argument(fmt::format("{}: k {} and v {} differ in shape", who, c10::str(k.sizes()), c10::str(v.sizes())));
  }
  if (q.size(1) != k.size(1) || q.size(2) != k.size(2)) {
    throw std::invalid_argument(fmt::format("{}: q {} and k {} differ in heads or head_dim", who, c10::str(q.sizes()),
                                            c10::str(k.sizes())));
  }
  if (q.scalar_type() != k.scalar_type() || q.scalar_type() != v.scalar_type()) {
    throw std::invalid_argument(fmt::format("{}: q, k, v dtypes differ ({}, {}, {})", who,
                                            c10::toString(q.scalar_type()), c10::toString(k.scalar_type()),
                                            c10::toString(v.scalar_type())));
  }
  const auto dtype = q.scalar_type();
  if (dtype != torch::kFloat && dtype != torch::kDouble && dtype != torch::kBFloat16) {
    throw std::invalid_argument(fmt::format("{}: dtype {} is not supported (fp32, fp64, bf16)", who,
                                            c10::toString(dtype)));
  }
  if (q.device() != k.device() || q.device() != v.device()) {
    throw std::invalid_argument(fmt::format("{}: q, k, v are on different devices", who));
  }
  VarlenBounds b{host_bounds(who, "cu_seqlens_q", cu_seqlens_q, q.size(0)),
                 host_bounds(who, "cu_seqlens_k", cu_seqlens_k, k.size(0))};
  if (b.q.size() != b.k.size()) {
    throw std::invalid_argument(fmt::format("{}: cu_seqlens_q has {} samples but cu_seqlens_k {}", who,
                                            b.q.size() - 1, b.k.size() - 1));
  }
  return b;
}

double attention_scale(const std::string& who, double scale, int64_t head_dim) {
  if (!std::isfinite(scale) || scale < 0) {
    throw std::invalid_argument(fmt::format("{}: scale must be a finite number >= 0 (0 = 1/sqrt(head_dim)), got {}",
                                            who, scale));
  }
  return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

}  // namespace dcp
