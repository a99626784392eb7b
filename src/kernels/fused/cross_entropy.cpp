// Fused cross-entropy over rows of logits: log-sum-exp and the target's log-probability in one pass forward,
// softmax minus the one-hot target in one pass backward; fp32 arithmetic on fp32 or bf16 logits.
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

constexpr float kLog2e = 1.4426950408889634f;

// Natural log-sum-exp of one row, through exp2 of (x - max) log2(e).
template <class T>
DCP_AVX512 float row_lse(const T* x, int64_t v) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t c = 0; c < v; c += kLanes) {
    const __mmask16 m = lanes_below(v - c);
    mx = _mm512_mask_max_ps(mx, m, mx, simd::load(x + c, m));
  }
  const float row_max = _mm512_reduce_max_ps(mx);
  const __m512 shift = _mm512_set1_ps(row_max * kLog2e), scale = _mm512_set1_ps(kLog2e);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c = 0; c < v; c += kLanes) {
    const __mmask16 m = lanes_below(v - c);
    const __m512 e = simd::exp2(_mm512_fmsub_ps(simd::load(x + c, m), scale, shift));
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
  }
  return row_max + std::log(_mm512_reduce_add_ps(sum));
}

// dx = g (softmax(x) - onehot(target)).
template <class T>
DCP_AVX512 void row_grad(const T* x, int64_t v, float lse, int64_t target, float g, T* dx) {
  const __m512 shift = _mm512_set1_ps(lse * kLog2e), scale = _mm512_set1_ps(kLog2e), vg = _mm512_set1_ps(g);
  for (int64_t c = 0; c < v; c += kLanes) {
    const __mmask16 m = lanes_below(v - c);
    __m512 p = _mm512_mul_ps(vg, simd::exp2(_mm512_fmsub_ps(simd::load(x + c, m), scale, shift)));
    if (target >= c && target < c + kLanes) {
      p = _mm512_mask_sub_ps(p, static_cast<__mmask16>(1u << (target - c)), p, vg);
    }
    simd::store(dx + c, p, m);
  }
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct CrossEntropyFunction : torch::autograd::Function<CrossEntropyFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& targets) {
    const int64_t rows = logits.size(0), v = logits.size(1);
    const torch::Tensor x = logits.contiguous();
    torch::Tensor lse = torch::empty({rows}, logits.options().dtype(torch::kFloat));
    torch::Tensor row_loss = torch::zeros({rows}, logits.options().dtype(torch::kDouble));
    const int64_t* t = targets.data_ptr<int64_t>();
    fused::with_dtype(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const T* xp = x.data_ptr<T>();
      float* lp = lse.data_ptr<float>();
      double* loss = row_loss.data_ptr<double>();
      fused::for_rows(rows, v * 8, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
          if (t[r] < 0) continue;  // ignore_index
          lp[r] = row_lse(xp + r * v, v);
          loss[r] = static_cast<double>(lp[r]) - static_cast<double>(static_cast<float>(xp[r * v + t[r]]));
        }
      });
    });
    ctx->save_for_backward({x, lse, targets});
    // Summed in fp64 over rows so that the total does not depend on the thread count.
    return row_loss.sum().to(torch::kFloat);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor& x = saved[0];
    const torch::Tensor& lse = saved[1];
    const torch::Tensor& targets = saved[2];
    const int64_t rows = x.size(0), v = x.size(1);
    const float g = grads[0].item<float>();
    torch::Tensor dx = torch::empty_like(x);
    const int64_t* t = targets.data_ptr<int64_t>();
    fused::with_dtype(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const T* xp = x.data_ptr<T>();
      const float* lp = lse.data_ptr<float>();
      T* dp = dx.data_ptr<T>();
      fused::for_rows(rows, v * 8, [&](int64_t b, int64_t e) {
        for (int64_t r = b; r < e; ++r) {
          if (t[r] < 0) {
            std::fill(dp + r * v, dp + (r + 1) * v, T(0));
          } else {
            row_grad(xp + r * v, v, lp[r], t[r], g, dp + r * v);
          }
        }
      });
    });
    return {dx, torch::Tensor()};
  }
};

}  // namespace

torch::Tensor cross_entropy_reference(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(
      logits.to(torch::kFloat), targets,
      torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kSum).ignore_index(-100));
}

torch::Tensor fused_cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets) {
  fused::check_rows("fused_cross_entropy", "logits", logits);
  if (logits.dim() != 2 || targets.dim() != 1 || targets.size(0) != logits.size(0) ||
      targets.scalar_type() != torch::kInt64) {
    throw std::invalid_argument(fmt::format("fused_cross_entropy: logits must be [rows, classes] and targets [rows] "
                                            "int64 (got {} and {} {})",
                                            c10::str(logits.sizes()), c10::str(targets.sizes()),
                                            c10::toString(targets.scalar_type())));
  }
  if (!fused::fused_path(logits)) return cross_entropy_reference(logits, targets);
  const torch::Tensor t = targets.to(logits.device()).contiguous();
  const int64_t* tp = t.data_ptr<int64_t>();
  for (int64_t r = 0; r < t.numel(); ++r) {
    if (tp[r] != -100 && (tp[r] < 0 || tp[r] >= logits.size(1))) {
      throw std::invalid_argument(fmt::format("fused_cross_entropy: target {} of row {} is outside [0, {}) "
                                              "(and not the ignore index -100)",
                                              tp[r], r, logits.size(1)));
    }
  }
  return CrossEntropyFunction::apply(logits, t);
}

}  // namespace dcp
