// train.precision: its values and auto's choice, and the dtypes a bf16 model keeps (fp32 master weights and
// gradients, bf16 activations, fp32 logits).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dcp/config.h"
#include "dcp/cpu_features.h"
#include "dcp/model.h"
#include "dcp/precision.h"
#include "unit/error_of.h"

using namespace dcp;
using dcp::test::error_of;

namespace {

ModelConfig tiny_config() {
  ModelConfig cfg;
  cfg.d_model = 32;
  cfg.n_layers = 2;
  cfg.n_heads = 4;
  cfg.d_ff = 64;
  return cfg;
}

PackedBatch random_batch(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> cu{0};
  std::vector<torch::Tensor> positions;
  for (int64_t len : lengths) {
    cu.push_back(cu.back() + len);
    positions.push_back(torch::arange(len, torch::kInt64));
  }
  PackedBatch b;
  b.tokens = torch::randint(0, kVocabSize, {cu.back()}, torch::kInt64);
  b.targets = torch::randint(0, 256, {cu.back()}, torch::kInt64);
  b.positions = torch::cat(positions);
  b.cu_seqlens = torch::tensor(cu, torch::kInt64);
  for (size_t i = 0; i < lengths.size(); ++i) b.sample_ids.push_back(static_cast<int64_t>(i));
  return b;
}

}  // namespace

TEST(Precision, AutoIsBf16ExactlyWhereBf16IsFast) {
  const PrecisionChoice c = resolve_precision("auto");
  EXPECT_EQ(c.precision == Precision::kBf16, bf16_is_fast()) << c.describe();
  EXPECT_EQ(c.reason.rfind("auto: ", 0), 0u) << c.reason;
  if (bf16_is_fast()) {
    // The reason names what made the choice, among the two extensions bf16_is_fast() looks at.
    EXPECT_EQ(c.reason.find("avx512_bf16") != std::string::npos, cpu_features().avx512_bf16) << c.reason;
    EXPECT_EQ(c.reason.find("amx_bf16") != std::string::npos, amx_usable()) << c.reason;
    EXPECT_EQ(c.describe(), "bf16 (" + c.reason + ")");
  } else {
    EXPECT_EQ(c.describe().rfind("fp32 (auto: this CPU has neither", 0), 0u) << c.describe();
  }
  EXPECT_EQ(Config{}.train.precision, "auto");  // the default
}

TEST(Precision, ExplicitValuesAndTheirWidths) {
  EXPECT_EQ(resolve_precision("bf16").precision, Precision::kBf16);
  EXPECT_EQ(resolve_precision("fp32").precision, Precision::kFp32);
  EXPECT_EQ(resolve_precision("fp32").describe(), "fp32 (train.precision=fp32)");
  EXPECT_EQ(activation_bytes(Precision::kBf16), 2);
  EXPECT_EQ(activation_bytes(Precision::kFp32), 4);
  EXPECT_EQ(precision_of_bytes(2), "bf16");
  EXPECT_EQ(precision_of_bytes(4), "fp32");
  EXPECT_EQ(precision_of_bytes(8), "8-byte elements");
  EXPECT_EQ(compute_dtype(Precision::kBf16), torch::kBFloat16);
  EXPECT_EQ(compute_dtype(Precision::kFp32), torch::kFloat);
}

TEST(Precision, BadValueNamesKeyValueAndAllowed) {
  for (const std::string& bad : {"fp16", "BF16", ""}) {
    for (const std::string& msg : {error_of([&] { Config::load("", {"--train.precision=" + bad}); }),
                                   error_of([&] { resolve_precision(bad); })}) {
      EXPECT_NE(msg.find("'train.precision'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("'" + bad + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("auto, bf16, fp32"), std::string::npos) << msg;
    }
    EXPECT_THROW(resolve_precision(bad), ConfigError);
  }
}

TEST(Precision, Bf16ModelKeepsFp32WeightsAndGradientsAndReturnsFp32Logits) {
  torch::manual_seed(3);
  Transformer model(tiny_config(), AttentionConfig{}, Precision::kBf16);
  const PackedBatch batch = random_batch({9, 30, 1});
  auto logits = model->forward(batch, /*recompute_layers=*/1);
  EXPECT_EQ(logits.scalar_type(), torch::kFloat);
  EXPECT_EQ(logits.size(0), 40);
  torch::Tensor loss = model->loss_sum(batch, 1);
  EXPECT_EQ(loss.scalar_type(), torch::kFloat);
  loss.backward();
  for (const auto& p : model->named_parameters()) {
    EXPECT_EQ(p.value().scalar_type(), torch::kFloat) << p.key();
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_EQ(p.value().grad().scalar_type(), torch::kFloat) << p.key();
    EXPECT_TRUE(torch::isfinite(p.value().grad()).all().item<bool>()) << p.key();
    EXPECT_GT(p.value().grad().abs().sum().item<double>(), 0.0) << p.key();
  }
}

TEST(Precision, BlocksNormsAndRotaryComputeInTheirInputsDtype) {
  torch::manual_seed(4);
  Transformer model(tiny_config(), AttentionConfig{}, Precision::kBf16);
  auto x = torch::randn({12, 32}).to(torch::kBFloat16);
  auto positions = torch::arange(12, torch::kInt64);
  auto cu = torch::tensor(std::vector<int64_t>{0, 12}, torch::kInt64);
  std::shared_ptr<BlockImpl> block = model->blocks->ptr<BlockImpl>(0);
  EXPECT_EQ(block->forward(x, positions, cu).scalar_type(), torch::kBFloat16);
  EXPECT_EQ(block->attn_norm(x).scalar_type(), torch::kBFloat16);
  auto q = torch::randn({12, 4, 8});
  auto rotated = apply_rotary(q.to(torch::kBFloat16), positions, 10000.0);
  EXPECT_EQ(rotated.scalar_type(), torch::kBFloat16);
  // bf16 rotary (fp32 arithmetic, one rounding) stays within bf16 rounding of the fp32 one (|q| entries ~ 1).
  EXPECT_LT((rotated.to(torch::kFloat) - apply_rotary(q, positions, 10000.0)).abs().max().item<double>(), 0.05);
}

TEST(Precision, PrecisionCanChangeBetweenForwardsOfTheSameWeights) {
  torch::manual_seed(5);
  Transformer model(tiny_config());
  EXPECT_EQ(model->precision, Precision::kFp32);
  const PackedBatch batch = random_batch({17, 23});
  torch::NoGradGuard no_grad;
  const double fp32 = model->loss_sum(batch).item<double>();
  model->precision = Precision::kBf16;
  const double bf16 = model->loss_sum(batch).item<double>();
  EXPECT_NE(bf16, fp32);  // the bf16 path did run
  EXPECT_NEAR(bf16, fp32, 1e-2 * fp32);  // ...and rounds, no more: the loss sums 40 token losses of ~5.5 nats
}
