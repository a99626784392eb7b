// Fused rotary position embedding: one pass per token forward and backward (the backward is the rotation by the
// opposite angle), with a cos/sin table per distinct position.
#include <fmt/format.h>
#include <torch/autograd.h>

#include <cmath>
#include <stdexcept>

#include "dcp/fused_ops.h"
#include "kernels/fused/rows.h"
#include "kernels/simd.h"

namespace dcp {
namespace {

using simd::lanes_below;
using simd::kLanes;

// Rotates one head's vector: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) over its two halves; sign -1 rotates
// by the opposite angle (the backward).
template <class T>
DCP_AVX512 void rotate_row(const T* x, const float* cos, const float* sin, float sign, T* y, int64_t half) {
  const __m512 sg = _mm512_set1_ps(sign);
  for (int64_t c = 0; c < half; c += kLanes) {
    const __mmask16 m = lanes_below(half - c);
    const __m512 x1 = simd::load(x + c, m), x2 = simd::load(x + half + c, m);
    const __m512 co = simd::load(cos + c, m), si = _mm512_mul_ps(sg, simd::load(sin + c, m));
    simd::store(y + c, _mm512_fnmadd_ps(x2, si, _mm512_mul_ps(x1, co)), m);
    simd::store(y + half + c, _mm512_fmadd_ps(x1, si, _mm512_mul_ps(x2, co)), m);
  }
}

// cos and sin of position * theta^(-2i/D), [table rows, D/2] each, and the table row of every token. Angles are
// computed as the reference does: fp32 position times the fp32 inverse frequency.
struct RotaryTable {
  torch::Tensor cos, sin;     // [rows, half] fp32
  std::vector<int64_t> row;   // [T]
};

RotaryTable rotary_table(const torch::Tensor& positions, int64_t head_dim, double theta) {
  const int64_t half = head_dim / 2, T = positions.numel();
  auto fp32 = torch::TensorOptions().dtype(torch::kFloat);
  const torch::Tensor inv = torch::pow(theta, -torch::arange(0, head_dim, 2, fp32) / static_cast<double>(head_dim));
  const float* inv_freq = inv.data_ptr<float>();
  const torch::Tensor pos = positions.to(torch::kCPU, torch::kInt64).contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  int64_t lo = 0, hi = 0;
  for (int64_t t = 0; t < T; ++t) {
    lo = std::min(lo, p[t]);
    hi = std::max(hi, p[t]);
  }
  RotaryTable table;
  // Positions restart per sample, so a table over [0, max] is small; far-apart absolute positions (decoding)
  // get one row per token instead.
  const bool by_position = lo >= 0 && hi < 4 * T + 64;
  const int64_t rows = by_position ? hi + 1 : T;
  table.cos = torch::empty({rows, half}, fp32);
  table.sin = torch::empty({rows, half}, fp32);
  float* c = table.cos.data_ptr<float>();
  float* s = table.sin.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float position = static_cast<float>(by_position ? r : p[r]);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = position * inv_freq[i];
      c[r * half + i] = std::cos(angle);
      s[r * half + i] = std::sin(angle);
    }
  }
  table.row.resize(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) table.row[static_cast<size_t>(t)] = by_position ? p[t] : t;
  return table;
}

// out[t, h] = rotate(x[t, h]) for every token and head; x strided by (sx0, sx1), out contiguous.
void rotate_all(const torch::Tensor& x, const RotaryTable& table, float sign, torch::Tensor& out) {
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  const int64_t sx0 = x.stride(0), sx1 = x.stride(1);
  const float* cos = table.cos.data_ptr<float>();
  const float* sin = table.sin.data_ptr<float>();
  fused::with_dtype(x.scalar_type(), [&](auto tag) {
    using T_ = decltype(tag);
    const T_* xp = x.data_ptr<T_>();
    T_* op = out.data_ptr<T_>();
    fused::for_rows(T, H * D * 4, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const int64_t r = table.row[static_cast<size_t>(t)];
        for (int64_t h = 0; h < H; ++h) {
          rotate_row(xp + t * sx0 + h * sx1, cos + r * half, sin + r * half, sign, op + (t * H + h) * D, half);
        }
      }
    });
  });
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct RotaryFunction : torch::autograd::Function<RotaryFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& positions,
                               double theta) {
    auto table = std::make_shared<RotaryTable>(rotary_table(positions, x.size(2), theta));
    torch::Tensor out = torch::empty(x.sizes(), x.options());
    rotate_all(x, *table, 1.0f, out);
    ctx->saved_data["table"] = c10::IValue::make_capsule(c10::make_intrusive<TableHolder>(table));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto holder = c10::static_intrusive_pointer_cast<TableHolder>(ctx->saved_data["table"].toCapsule());
    const torch::Tensor dy = grads[0].stride(-1) == 1 ? grads[0] : grads[0].contiguous();
    torch::Tensor dx = torch::empty(dy.sizes(), dy.options());
    rotate_all(dy, *holder->table, -1.0f, dx);
    return {dx, torch::Tensor(), torch::Tensor()};
  }
  // AutogradContext stores IValues; the table travels as a capsule.
  struct TableHolder : torch::CustomClassHolder {
    explicit TableHolder(std::shared_ptr<RotaryTable> t) : table(std::move(t)) {}
    std::shared_ptr<RotaryTable> table;
  };
};

// Pairs dimension i with i + D/2 (the "rotate_half" layout of GPT-NeoX / LLaMA).
torch::Tensor rotate_half(const torch::Tensor& x) {
  auto halves = x.chunk(2, -1);
  return torch::cat({-halves[1], halves[0]}, -1);
}

void check_rotary(const torch::Tensor& x, const torch::Tensor& positions) {
  fused::check_rows("rotary", "x", x);
  if (x.dim() != 3 || x.size(2) % 2 != 0) {
    throw std::invalid_argument(
        fmt::format("rotary: x must be [T, heads, head_dim] with an even head_dim (got {})", c10::str(x.sizes())));
  }
  if (positions.dim() != 1 || positions.size(0) != x.size(0)) {
    throw std::invalid_argument(
        fmt::format("rotary: positions must be [{}] (got {})", x.size(0), c10::str(positions.sizes())));
  }
}

}  // namespace

torch::Tensor rotary_reference(const torch::Tensor& x, const torch::Tensor& positions, double theta) {
  check_rotary(x, positions);
  const int64_t head_dim = x.size(-1);
  // Angles in fp32 even for half-precision activations: position * frequency needs the mantissa.
  auto fp32 = torch::TensorOptions().dtype(torch::kFloat).device(x.device());
  auto inv_freq = torch::pow(theta, -torch::arange(0, head_dim, 2, fp32) / static_cast<double>(head_dim));  // [D/2]
  auto angles = positions.to(fp32).unsqueeze(1) * inv_freq.unsqueeze(0);  // [T, D/2]
  auto cos = torch::cat({angles.cos(), angles.cos()}, -1).unsqueeze(1);  // [T, 1, D]
  auto sin = torch::cat({angles.sin(), angles.sin()}, -1).unsqueeze(1);
  auto xf = x.to(torch::kFloat);
  return (xf * cos + rotate_half(xf) * sin).to(x.scalar_type());
}

torch::Tensor fused_rotary(const torch::Tensor& x, const torch::Tensor& positions, double theta) {
  check_rotary(x, positions);
  if (!fused::fused_path(x)) return rotary_reference(x, positions, theta);
  return RotaryFunction::apply(x, positions, theta);
}

}  // namespace dcp
