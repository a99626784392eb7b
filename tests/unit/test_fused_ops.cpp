// The fused elementwise kernels (include/dcp/fused_ops.h) against their plain ATen twins: outputs and gradients,
// fp32 and bf16, widths that are and are not multiples of the 16 AVX-512 lanes, strided inputs.
//
// Tolerances (max |fused - reference| / max(1, max |reference|)):
// | dtype | out | gradients | why |
// |---|---|---|---|
// | fp32 | 1e-5 | 1e-5 | the same fp32 formulas in another order (a row sum of d terms: ~sqrt(d) ulp), exp by a
//   1-ulp polynomial; measured <= 1e-6 |
// | bf16 | 1.6e-2 | 1.6e-2 | both round fp32 results to bf16 once (2^-9 relative), so they differ by at most one
//   bf16 ulp (2^-8 of the value: 3.9e-3 relative, 1.6e-2 absolute at |x| = 4) where the fp32 values straddle a
//   rounding boundary |
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <functional>
#include <limits>
#include <string>

#include "dcp/cpu_features.h"
#include "dcp/fused_ops.h"

namespace dcp {
namespace {

double rel_err(const torch::Tensor& got, const torch::Tensor& want) {
  auto g = got.to(torch::kDouble), w = want.to(torch::kDouble);
  return (g - w).abs().max().item<double>() / std::max(1.0, w.abs().max().item<double>());
}

double tolerance(torch::ScalarType dtype) { return dtype == torch::kFloat ? 1e-5 : 1.6e-2; }

using Op = std::function<torch::Tensor(const std::vector<torch::Tensor>&)>;

// Runs op on leaves cloned from `inputs` and returns the output and the gradients of sum(out * g).
std::vector<torch::Tensor> run(const Op& op, const std::vector<torch::Tensor>& inputs, const torch::Tensor& g) {
  std::vector<torch::Tensor> leaves;
  for (const auto& t : inputs) leaves.push_back(t.detach().clone().requires_grad_(t.is_floating_point()));
  auto out = op(leaves);
  (out.to(torch::kFloat) * g).sum().backward();
  std::vector<torch::Tensor> r{out.detach()};
  for (const auto& l : leaves) {
    if (l.requires_grad()) r.push_back(l.grad());
  }
  return r;
}

void expect_same(const Op& fused, const Op& reference, const std::vector<torch::Tensor>& inputs,
                 const torch::Tensor& g, torch::ScalarType dtype, const std::string& what) {
  auto a = run(fused, inputs, g), b = run(reference, inputs, g);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].scalar_type(), b[i].scalar_type()) << what << " tensor " << i;
    EXPECT_EQ(a[i].sizes(), b[i].sizes()) << what << " tensor " << i;
    const double e = rel_err(a[i], b[i]);
    EXPECT_LE(e, tolerance(dtype)) << what << " tensor " << i;
    std::printf("%-40s tensor %zu: %.2e\n", what.c_str(), i, e);
  }
}

std::string name(torch::ScalarType dtype) { return dtype == torch::kFloat ? "fp32" : "bf16"; }

TEST(FusedOps, UseTheAvx512KernelsHere) {
  if (!avx512_usable()) GTEST_SKIP() << "no AVX-512: the fused ops run their plain twins";
}

TEST(FusedOps, RmsNormMatchesItsTwin) {
  torch::manual_seed(1);
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (int64_t d : {128, 100, 7}) {
      auto x = (torch::randn({67, d}) * 3).to(dtype);
      auto w = torch::rand({d}) + 0.5;
      auto g = torch::randn({67, d});
      const double eps = 1e-6;
      expect_same([&](const auto& in) { return fused_rms_norm(in[0], in[1], eps); },
                  [&](const auto& in) { return rms_norm_reference(in[0], in[1], eps); }, {x, w}, g, dtype,
                  "rms_norm " + name(dtype) + " d" + std::to_string(d));
    }
  }
}

TEST(FusedOps, RotaryMatchesItsTwinOnStridedViews) {
  torch::manual_seed(2);
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (int64_t D : {32, 64, 24}) {
      const int64_t T = 50, H = 3;
      // q of a packed [T, 3, H, D] projection: token stride 3 H D, like the block's qkv.
      auto qkv = (torch::randn({T, 3, H, D}) * 2).to(dtype);
      std::vector<int64_t> pos;
      for (int64_t t = 0; t < T; ++t) pos.push_back(t % 17);  // positions restart per sample
      auto positions = torch::tensor(pos, torch::kInt64);
      auto g = torch::randn({T, H, D});
      expect_same([&](const auto& in) { return fused_rotary(in[0].select(1, 0), in[1], 10000.0); },
                  [&](const auto& in) { return rotary_reference(in[0].select(1, 0), in[1], 10000.0); },
                  {qkv, positions}, g, dtype, "rotary " + name(dtype) + " D" + std::to_string(D));
    }
  }
  // Far-apart absolute positions (decoding) take the per-token table.
  auto x = torch::randn({4, 2, 32});
  auto far = torch::tensor(std::vector<int64_t>{5, 100000, 7, 2000000}, torch::kInt64);
  EXPECT_LE(rel_err(fused_rotary(x, far, 10000.0), rotary_reference(x, far, 10000.0)), 1e-4);
}

TEST(FusedOps, SwiGluMatchesItsTwinOnOneProjection) {
  torch::manual_seed(3);
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (int64_t F : {384, 37}) {
      auto gate_up = (torch::randn({45, 2 * F}) * 3).to(dtype);
      auto g = torch::randn({45, F});
      expect_same(
          [&](const auto& in) { return fused_swiglu(in[0]); }, [&](const auto& in) { return swiglu_reference(in[0]); },
          {gate_up}, g, dtype, "swiglu " + name(dtype) + " F" + std::to_string(F));
    }
  }
}

TEST(FusedOps, SwiGluSaturatesAtExtremeGates) {
  auto gate = torch::tensor({-1e4f, -100.0f, -30.0f, 0.0f, 30.0f, 100.0f, 1e4f}).view({1, 7});
  auto gate_up = torch::cat({gate, torch::ones({1, 7})}, 1);
  EXPECT_LE(rel_err(fused_swiglu(gate_up), swiglu_reference(gate_up)), 1e-6);
  EXPECT_TRUE(torch::isfinite(fused_swiglu(gate_up)).all().item<bool>());
  auto nan_gate = torch::cat({torch::full({1, 3}, std::numeric_limits<float>::quiet_NaN()), torch::ones({1, 3})}, 1);
  EXPECT_TRUE(torch::isnan(fused_swiglu(nan_gate)).all().item<bool>());
}

TEST(FusedOps, CrossEntropyMatchesItsTwinWithIgnoredTargets) {
  torch::manual_seed(4);
  for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (int64_t classes : {256, 37}) {
      auto logits = (torch::randn({70, classes}) * 4).to(dtype);
      auto targets = torch::randint(0, classes, {70}, torch::kInt64);
      targets[3] = -100;
      targets[50] = -100;
      auto g = torch::full({}, 0.37);
      expect_same([&](const auto& in) { return fused_cross_entropy(in[0], in[1]); },
                  [&](const auto& in) { return cross_entropy_reference(in[0], in[1]); }, {logits, targets}, g, dtype,
                  "cross_entropy " + name(dtype) + " V" + std::to_string(classes));
    }
  }
}

TEST(FusedOps, BadInputsAreRefusedWithTheirNames) {
  auto expect_error = [](const std::function<void()>& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "no error, expected one mentioning '" << needle << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto x = torch::randn({4, 8});
  expect_error([&] { fused_rms_norm(x, torch::ones({7}), 1e-6); }, "weight must be fp32 [8]");
  expect_error([&] { fused_rms_norm(x.to(torch::kDouble), torch::ones({8}), 1e-6); }, "dtype Double");
  expect_error([&] { fused_rms_norm(x.t(), torch::ones({4}), 1e-6); }, "contiguous in its last dimension");
  expect_error([&] { fused_rotary(torch::randn({4, 2, 7}), torch::zeros({4}, torch::kInt64), 1e4); },
               "even head_dim");
  expect_error([&] { fused_rotary(torch::randn({4, 2, 8}), torch::zeros({3}, torch::kInt64), 1e4); },
               "positions must be [4]");
  expect_error([&] { fused_swiglu(torch::randn({4, 9})); }, "gate_up must be [rows, 2F]");
  expect_error([&] { fused_cross_entropy(x, torch::tensor(std::vector<int64_t>{0, 1, 8, 2})); },
               "target 8 of row 2 is outside [0, 8)");
  expect_error([&] { fused_cross_entropy(x, torch::zeros({3}, torch::kInt64)); }, "targets [rows] int64");
}

}  // namespace
}  // namespace dcp
