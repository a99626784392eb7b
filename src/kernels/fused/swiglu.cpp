// Fused SwiGLU gate: h = silu(gate) * up in one pass, and its backward in one pass.
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
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& gate, const torch::Tensor& up) {
    const int64_t rows = gate.size(0), f = gate.size(1);
    torch::Tensor h = torch::empty({rows, f}, gate.options());
    fused::with_dtype(gate.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const T* gp = gate.data_ptr<T>();
      const T* up_p = up.data_ptr<T>();
      T* hp = h.data_ptr<T>();
      const int64_t sg = gate.stride(0), su = up.stride(0);
      fused::for_rows(rows, f * 8, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) swiglu_row(gp + r * sg, up_p + r * su, hp + r * f, f);
      });
    });
    ctx->save_for_backward({gate, up});
    return h;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& gate = saved[0];
    const torch::Tensor& up = saved[1];
    const torch::Tensor dh = grads[0].to(gate.scalar_type()).contiguous();
    const int64_t rows = gate.size(0), f = gate.size(1);
    torch::Tensor dg = torch::empty({rows, f}, gate.options()), du = torch::empty({rows, f}, gate.options());
    fused::with_dtype(gate.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const T* gp = gate.data_ptr<T>();
      const T* up_p = up.data_ptr<T>();
      const T* dp = dh.data_ptr<T>();
      T* dgp = dg.data_ptr<T>();
      T* dup = du.data_ptr<T>();
      const int64_t sg = gate.stride(0), su = up.stride(0);
      fused::for_rows(rows, f * 16, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
          swiglu_row_backward(gp + r * sg, up_p + r * su, dp + r * f, dgp + r * f, dup + r * f, f);
        }
      });
    });
    return {dg, du};
  }
};

}  // namespace

torch::Tensor swiglu_reference(const torch::Tensor& gate, const torch::Tensor& up) {
  return (torch::silu(gate.to(torch::kFloat)) * up.to(torch::kFloat)).to(gate.scalar_type());
}

torch::Tensor fused_swiglu(const torch::Tensor& gate, const torch::Tensor& up) {
  fused::check_rows("fused_swiglu", "gate", gate);
  fused::check_rows("fused_swiglu", "up", up);
  if (gate.dim() != 2 || gate.sizes() != up.sizes() || gate.scalar_type() != up.scalar_type()) {
    throw std::invalid_argument(fmt::format("fused_swiglu: gate {} {} and up {} {} must be [rows, F] of one dtype",
                                            c10::str(gate.sizes()), c10::toString(gate.scalar_type()),
                                            c10::str(up.sizes()), c10::toString(up.scalar_type())));
  }
  if (!fused::fused_path(gate)) return swiglu_reference(gate, up);
  return SwiGluFunction::apply(gate, up);
}

}  // namespace dcp
