// Fused SwiGLU gate on one [rows, 2F] projection: h = silu(gate) * up in one pass, and its backward in one pass.
#include <fmt/format.h>
#include <torch/autograd.h>

#include <stdexcept>

#include "dcp/fused_ops.h"
#include "kernels/fused/rows.h"
#include "kernels/simd.h"

namespace dcp {
namespace {

using simd::lanes_below;
using simd::kLanes;

template <class T>
DCP_AVX512 void swiglu_row(const T* g, const T* u, T* h, int64_t f) {
  for (int64_t c = 0; c < f; c += kLanes) {
    const __mmask16 m = lanes_below(f - c);
    const __m512 x = simd::load(g + c, m);
    simd::store(h + c, _mm512_mul_ps(_mm512_mul_ps(x, simd::sigmoid(x)), simd::load(u + c, m)), m);
  }
}

// With s = sigmoid(g): d/dg [g s] = s (1 + g (1 - s)), so dg = dh u s (1 + g (1 - s)) and du = dh g s.
template <class T>
DCP_AVX512 void swiglu_row_backward(const T* g, const T* u, const T* dh, T* dg, T* du, int64_t f) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t c = 0; c < f; c += kLanes) {
    const __mmask16 m = lanes_below(f - c);
    const __m512 x = simd::load(g + c, m), up = simd::load(u + c, m), d = simd::load(dh + c, m);
    const __m512 s = simd::sigmoid(x);
    const __m512 slope = _mm512_mul_ps(s, _mm512_fmadd_ps(x, _mm512_sub_ps(one, s), one));
    simd::store(dg + c, _mm512_mul_ps(_mm512_mul_ps(d, up), slope), m);
    simd::store(du + c, _mm512_mul_ps(d, _mm512_mul_ps(x, s)), m);
  }
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct SwiGluFunction : torch::autograd::Function<SwiGluFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& gate_up) {
    const torch::Tensor x = gate_up.stride(-1) == 1 && gate_up.stride(0) == gate_up.size(1) ? gate_up
                                                                                          : gate_up.contiguous();
    const int64_t rows = x.size(0), f = x.size(1) / 2;
    torch::Tensor h = torch::empty({rows, f}, x.options());
    fused::with_dtype(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const T* xp = x.data_ptr<T>();
      T* hp = h.data_ptr<T>();
      fused::for_rows(rows, f * 8, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) swiglu_row(xp + r * 2 * f, xp + r * 2 * f + f, hp + r * f, f);
      });
    });
    ctx->save_for_backward({x});
    return h;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const torch::Tensor x = ctx->get_saved_variables()[0];
    const torch::Tensor dh = grads[0].to(x.scalar_type()).contiguous();
    const int64_t rows = x.size(0), f = x.size(1) / 2;
    torch::Tensor dx = torch::empty_like(x);
    fused::with_dtype(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const T* xp = x.data_ptr<T>();
      const T* dp = dh.data_ptr<T>();
      T* dxp = dx.data_ptr<T>();
      fused::for_rows(rows, f * 16, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
          const int64_t at = r * 2 * f;
          swiglu_row_backward(xp + at, xp + at + f, dp + r * f, dxp + at, dxp + at + f, f);
        }
      });
    });
    return {dx};
  }
};

}  // namespace

torch::Tensor swiglu_reference(const torch::Tensor& gate_up) {
  const auto halves = gate_up.to(torch::kFloat).chunk(2, -1);
  return (torch::silu(halves[0]) * halves[1]).to(gate_up.scalar_type());
}

torch::Tensor fused_swiglu(const torch::Tensor& gate_up) {
  fused::check_rows("fused_swiglu", "gate_up", gate_up);
  if (gate_up.dim() != 2 || gate_up.size(1) % 2 != 0) {
    throw std::invalid_argument(fmt::format("fused_swiglu: gate_up must be [rows, 2F] (got {})",
                                            c10::str(gate_up.sizes())));
  }
  if (!fused::fused_path(gate_up)) return swiglu_reference(gate_up);
  return SwiGluFunction::apply(gate_up);
}

}  // namespace dcp
