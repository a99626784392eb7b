// Fused RMSNorm: one pass per row forward (sum of squares, then scale and gain) and one backward.
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

// Forward of one row: rstd = 1 / sqrt(mean(x^2) + eps), y = x rstd w.
template <class T>
DCP_AVX512 float rms_norm_row(const T* x, const float* w, T* y, int64_t d, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += kLanes) {
    const __m512 v = simd::load(x + c, lanes_below(d - c));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float rstd = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(d) + eps);
  const __m512 r = _mm512_set1_ps(rstd);
  for (int64_t c = 0; c < d; c += kLanes) {
    const __mmask16 m = lanes_below(d - c);
    simd::store(y + c, _mm512_mul_ps(_mm512_mul_ps(simd::load(x + c, m), r), simd::load(w + c, m)), m);
  }
  return rstd;
}

// Backward of one row, with g = dy w and n = x rstd: dx = rstd (g - n mean(g n)); dw += dy n.
template <class T>
DCP_AVX512 void rms_norm_row_backward(const T* x, const T* dy, const float* w, float rstd, T* dx, float* dw,
                                      int64_t d) {
  const __m512 r = _mm512_set1_ps(rstd);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += kLanes) {
    const __mmask16 m = lanes_below(d - c);
    const __m512 n = _mm512_mul_ps(simd::load(x + c, m), r);
    const __m512 g = simd::load(dy + c, m);
    acc = _mm512_fmadd_ps(_mm512_mul_ps(g, simd::load(w + c, m)), n, acc);
    simd::store(dw + c, _mm512_fmadd_ps(g, n, simd::load(dw + c, m)), m);
  }
  const __m512 mean = _mm512_set1_ps(_mm512_reduce_add_ps(acc) / static_cast<float>(d));
  for (int64_t c = 0; c < d; c += kLanes) {
    const __mmask16 m = lanes_below(d - c);
    const __m512 n = _mm512_mul_ps(simd::load(x + c, m), r);
    const __m512 g = _mm512_mul_ps(simd::load(dy + c, m), simd::load(w + c, m));
    simd::store(dx + c, _mm512_mul_ps(r, _mm512_fnmadd_ps(n, mean, g)), m);
  }
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct RmsNormFunction : torch::autograd::Function<RmsNormFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight,
                               double eps) {
    const int64_t d = x.size(-1), rows = x.numel() / std::max<int64_t>(d, 1);
    const torch::Tensor xc = x.contiguous(), w = weight.contiguous();
    torch::Tensor y = torch::empty_like(xc);
    torch::Tensor rstd = torch::empty({rows}, x.options().dtype(torch::kFloat));
    fused::with_dtype(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const T* xp = xc.data_ptr<T>();
      T* yp = y.data_ptr<T>();
      float* rp = rstd.data_ptr<float>();
      const float* wp = w.data_ptr<float>();
      fused::for_rows(rows, d * 4, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) rp[r] = rms_norm_row(xp + r * d, wp, yp + r * d, d, static_cast<float>(eps));
      });
    });
    ctx->save_for_backward({xc, w, rstd});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& x = saved[0];
    const torch::Tensor& w = saved[1];
    const torch::Tensor& rstd = saved[2];
    const torch::Tensor dy = grads[0].to(x.scalar_type()).contiguous();
    const int64_t d = x.size(-1), rows = x.numel() / std::max<int64_t>(d, 1);
    torch::Tensor dx = torch::empty_like(x);
    // Each thread sums its rows' gain gradients in its own row, reduced after the loop (deterministic for a
    // thread count: at::parallel_for hands out the same chunks).
    const int64_t threads = at::get_num_threads();
    torch::Tensor dw_parts = torch::zeros({threads, d}, w.options());
    fused::with_dtype(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const T* xp = x.data_ptr<T>();
      const T* gp = dy.data_ptr<T>();
      T* dxp = dx.data_ptr<T>();
      const float* wp = w.data_ptr<float>();
      const float* rp = rstd.data_ptr<float>();
      float* parts = dw_parts.data_ptr<float>();
      fused::for_rows(rows, d * 4, [&](int64_t b, int64_t e) {
        float* dw = parts + at::get_thread_num() * d;
        for (int64_t r = b; r < e; ++r) rms_norm_row_backward(xp + r * d, gp + r * d, wp, rp[r], dxp + r * d, dw, d);
      });
    });
    return {dx, dw_parts.sum(0), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor rms_norm_reference(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  // Normalise in fp32: the mean of squares overflows or loses precision in half types. The fp32 gain is applied
  // before the one cast back, so that a bf16 input gives a bf16 output (and the gain an fp32 gradient).
  auto xf = x.to(torch::kFloat);
  auto normed = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return (normed * weight).to(x.scalar_type());
}

torch::Tensor fused_rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  fused::check_rows("fused_rms_norm", "x", x);
  if (weight.dim() != 1 || weight.size(0) != x.size(-1) || weight.scalar_type() != torch::kFloat) {
    throw std::invalid_argument(fmt::format("fused_rms_norm: weight must be fp32 [{}] (got {} {})", x.size(-1),
                                            c10::str(weight.sizes()), c10::toString(weight.scalar_type())));
  }
  if (!fused::fused_path(x)) return rms_norm_reference(x, weight, eps);
  return RmsNormFunction::apply(x, weight, eps);
}

}  // namespace dcp
