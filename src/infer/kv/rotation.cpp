// Rotary rotations for the KV policies (src/infer/kv/rotation.h).
#include "infer/kv/rotation.h"

#include <fmt/format.h>

#include <stdexcept>

namespace dcp {
namespace {

// inv_freq_i = theta^(-2i / head_dim), i < head_dim / 2, fp64.
torch::Tensor inverse_frequencies(int64_t head_dim, double theta) {
  return torch::pow(theta, -torch::arange(0, head_dim, 2, torch::kDouble) / static_cast<double>(head_dim));
}

}  // namespace

torch::Tensor kv_rotate(const torch::Tensor& x, const torch::Tensor& positions, double theta, double sign) {
  if (x.dim() != 3 || x.size(2) % 2 != 0 || positions.dim() != 1 || positions.numel() != x.size(0) ||
      !(theta > 0)) {
    throw std::invalid_argument(fmt::format(
        "kv_rotate: x must be [T, heads, even head_dim] with T positions and theta > 0; got x {}, {} positions, "
        "theta {}", c10::str(x.sizes()), positions.numel(), theta));
  }
  const int64_t half = x.size(2) / 2;
  const torch::Tensor angle = positions.to(torch::kDouble).unsqueeze(1) * inverse_frequencies(x.size(2), theta);
  const torch::Tensor c = angle.cos().unsqueeze(1), s = (sign * angle.sin()).unsqueeze(1);  // [T, 1, half]
  const torch::Tensor xd = x.to(torch::kDouble);
  const torch::Tensor x1 = xd.narrow(2, 0, half), x2 = xd.narrow(2, half, half);
  return torch::cat({x1 * c - x2 * s, x2 * c + x1 * s}, 2);
}

torch::Tensor kv_mean_rotation(int64_t head_dim, int64_t first, int64_t count, double theta) {
  if (head_dim < 2 || head_dim % 2 != 0 || count < 1 || !(theta > 0)) {
    throw std::invalid_argument(fmt::format("kv_mean_rotation: head_dim {} must be even, count {} >= 1, theta {} > 0",
                                            head_dim, count, theta));
  }
  const int64_t half = head_dim / 2;
  const torch::Tensor t = torch::arange(first, first + count, torch::kDouble).unsqueeze(1);
  const torch::Tensor angle = t * inverse_frequencies(head_dim, theta);  // [count, half]
  const torch::Tensor c = angle.cos().mean(0), s = angle.sin().mean(0);  // [half]
  // R(t) = [[diag cos, -diag sin], [diag sin, diag cos]] in the (x1, x2) halves; the mean is the same form.
  torch::Tensor r = torch::zeros({head_dim, head_dim}, torch::kDouble);
  const torch::Tensor idx = torch::arange(half, torch::kInt64);
  r.index_put_({idx, idx}, c);
  r.index_put_({idx + half, idx + half}, c);
  r.index_put_({idx, idx + half}, -s);
  r.index_put_({idx + half, idx}, s);
  return r;
}

}  // namespace dcp
