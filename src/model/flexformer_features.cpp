// Input conditioning and feature maps of Flexformer (docs/flexformer.md, "Feature maps").
#include <cmath>
#include <stdexcept>
#include <string>

#include "dcp/flexformer.h"

namespace dcp {
namespace {

// Keeps the norms differentiable at x = 0 (a padding token's q or k can be all zeros); the fused kernel uses it too.
constexpr double kNormEps = kInputNormEps;

void check_omega(const torch::Tensor& x, const torch::Tensor& omega, const char* what) {
  if (x.dim() != 3 || omega.dim() != 3 || omega.size(0) != x.size(1) || omega.size(2) != x.size(2)) {
    throw std::invalid_argument(std::string(what) + ": x must be [T, heads, d] and omega [heads, m, d] with the same "
                                "heads and d, got x of " + std::to_string(x.dim()) + " dims and omega of " +
                                std::to_string(omega.dim()) + " dims" +
                                (x.dim() == 3 && omega.dim() == 3
                                     ? " (x heads " + std::to_string(x.size(1)) + ", d " + std::to_string(x.size(2)) +
                                           "; omega heads " + std::to_string(omega.size(0)) + ", d " +
                                           std::to_string(omega.size(2)) + ")"
                                     : std::string()));
  }
}

// Omega x per head: x [T, H, d], omega [H, m, d] -> [T, H, m].
torch::Tensor project(const torch::Tensor& x, const torch::Tensor& omega) {
  return torch::matmul(x.transpose(0, 1), omega.transpose(1, 2)).transpose(0, 1);
}

}  // namespace

torch::Tensor condition_input(const torch::Tensor& x, InputNorm norm) {
  const double d = static_cast<double>(x.size(-1));
  switch (norm) {
    case InputNorm::kL2: return x * torch::rsqrt(x.pow(2).sum(-1, /*keepdim=*/true) + kNormEps);
    case InputNorm::kRms:
      return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + kNormEps) * std::pow(d, -0.25);
    case InputNorm::kScale: return x * std::pow(d, -0.25);
  }
  throw std::invalid_argument("condition_input: unknown InputNorm");
}

torch::Tensor fourier_features(const torch::Tensor& x, const torch::Tensor& omega) {
  check_omega(x, omega, "fourier_features");
  auto u = project(x, omega);
  return torch::cat({u.cos(), u.sin()}, -1) / std::sqrt(static_cast<double>(omega.size(1)));
}

torch::Tensor nonstationary_fourier_features(const torch::Tensor& x, const torch::Tensor& omega1,
                                             const torch::Tensor& omega2) {
  check_omega(x, omega1, "nonstationary_fourier_features");
  if (omega2.sizes() != omega1.sizes()) {
    throw std::invalid_argument("nonstationary_fourier_features: omega1 and omega2 must have the same shape");
  }
  // Summing, not concatenating, the two maps: a concatenation would be a sum of two stationary kernels.
  auto u1 = project(x, omega1), u2 = project(x, omega2);
  return torch::cat({u1.cos() + u2.cos(), u1.sin() + u2.sin()}, -1) /
         std::sqrt(4.0 * static_cast<double>(omega1.size(1)));
}

torch::Tensor elu_features(const torch::Tensor& x) { return torch::elu(x) + 1.0; }

}  // namespace dcp
