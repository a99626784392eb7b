// Recurrent decoding of flexformer models (RecurrentSession): a prompt in chunks and then tokens one at a time
// equal the full forward over the whole sequence; several sessions in one batched step equal each run alone; the
// states hold the same bytes after any number of tokens; what does not fit is refused.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

#include "dcp/flexformer.h"
#include "dcp/infer.h"
#include "dcp/kv_policies.h"
#include "unit/kv_test_model.h"

using namespace dcp;
using dcp::test::full_forward;
using dcp::test::random_tokens;

namespace {

AttentionConfig flex_attention(const std::string& impl, const std::string& feature_map = "stationary") {
  AttentionConfig a;
  a.backend = "flexformer";
  a.feature_map = feature_map;
  a.num_features = 8;
  a.chunk_size = 4;
  a.linear_impl = impl;
  return a;
}

Transformer flex_model(const std::string& impl, uint64_t seed = 31, Precision precision = Precision::kFp32,
                       const std::string& feature_map = "stationary") {
  torch::manual_seed(seed);
  // d_model 32, 3 layers, 4 heads of 8 (test_flexformer's shape).
  ModelConfig cfg = dcp::test::kv_tiny_config(3);
  cfg.d_model = 32;
  cfg.d_ff = 64;
  Transformer model(cfg, flex_attention(impl, feature_map), precision);
  model->eval();
  return model;
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

}  // namespace

// Tolerances (this random model's logits are of magnitude ~1): the chunked scan and the full forward sum the same
// terms in another order (the prefill's chunk boundaries, one-token steps), so in fp32 they differ by rounding,
// measured 1.2e-7 to 1.5e-7; 1e-5 leaves ~70x room. In bf16 every layer's output is rounded to 8 bits of mantissa
// and a different summation order can move a logit by one bf16 step (2^-9 at magnitude ~0.5: measured 0.00195);
// 0.01 allows a few. What they must tell apart: the same last 50 tokens decoded after only the 50 before them
// (the first 200 tokens lost, positions from 0 instead of 200) differ by ~0.027 (checked below in fp32, where the
// margin is wide).
TEST(RecurrentSession, ChunkedPrefillThenTokensEqualTheFullForward) {
  struct Case {
    std::string impl, feature_map;
    Precision precision;
    double tolerance;
  };
  for (const Case& c : {Case{"fused", "stationary", Precision::kFp32, 1e-5}, Case{"reference", "stationary", Precision::kFp32, 1e-5},
                        Case{"fused", "elu", Precision::kFp32, 1e-5}, Case{"fused", "stationary", Precision::kBf16, 0.01}}) {
    Transformer model = flex_model(c.impl, 31, c.precision, c.feature_map);
    const std::vector<int64_t> tokens = random_tokens(300, 7);
    const torch::Tensor expected = full_forward(model, tokens);
    for (int64_t chunk : {16, 37, 512}) {
      RecurrentSession session(model, chunk);
      const int64_t prompt = 250;
      std::vector<torch::Tensor> rows{session.prefill(std::vector<int64_t>(tokens.begin(), tokens.begin() + prompt))};
      EXPECT_EQ(session.next_position(), prompt);
      for (size_t i = prompt; i < tokens.size(); ++i) rows.push_back(session.decode(tokens[i]).unsqueeze(0));
      const torch::Tensor got = torch::cat(rows);
      ASSERT_EQ(got.sizes(), expected.sizes());
      EXPECT_EQ(got.scalar_type(), torch::kFloat);
      EXPECT_LE(max_abs_diff(got, expected), c.tolerance) << c.impl << " " << c.feature_map << " chunk " << chunk;
    }
    if (c.precision == Precision::kFp32) {
      RecurrentSession late(model, 64);
      std::vector<torch::Tensor> rows{late.prefill(std::vector<int64_t>(tokens.begin() + 200, tokens.begin() + 250))};
      for (size_t i = 250; i < tokens.size(); ++i) rows.push_back(late.decode(tokens[i]).unsqueeze(0));
      EXPECT_GT(max_abs_diff(torch::cat(rows).slice(0, 49), expected.slice(0, 249)), 100 * c.tolerance)
          << c.impl << " " << c.feature_map << ": the tolerance cannot tell a lost context apart";
    }
  }
}

TEST(RecurrentSession, StatesHoldTheSameBytesAfterAnyNumberOfTokensAndResetStartsOver) {
  Transformer model = flex_model("fused");
  RecurrentSession session(model, 64);
  EXPECT_EQ(session.state_bytes(), 0);
  const std::vector<int64_t> tokens = random_tokens(200, 3);
  const torch::Tensor first = session.prefill({tokens[0]});
  // 3 layers x 4 heads x F x (Dv + 1) fp32 values: F = 2m + 1 = 17 (the shift feature), Dv = 8.
  const int64_t expected = 3 * 4 * 17 * (8 + 1) * 4;
  EXPECT_EQ(session.state_bytes(), expected);
  session.prefill(std::vector<int64_t>(tokens.begin() + 1, tokens.end()));
  EXPECT_EQ(session.state_bytes(), expected);
  session.reset();
  EXPECT_EQ(session.state_bytes(), 0);
  EXPECT_EQ(session.next_position(), 0);
  EXPECT_TRUE(torch::equal(session.prefill({tokens[0]}), first));
}

// Sessions join one step after another, prefill in chunks beside others' one-token steps, then decode together:
// every session's logits equal its solo run's up to the rounding of the batched matmuls (fp32: 1e-5 on logits of
// magnitude ~1), and the bytes drawn greedily are the same.
TEST(RecurrentSession, BatchedStepsEqualEachSessionRunAlone) {
  for (const std::string impl : {"fused", "reference"}) {
    Transformer model = flex_model(impl, 5);
    const std::vector<int64_t> prompt_lengths{3, 40, 17, 1};
    std::vector<std::unique_ptr<RecurrentSession>> batched, solo;
    std::vector<std::vector<int64_t>> prompts;
    for (size_t i = 0; i < prompt_lengths.size(); ++i) {
      batched.push_back(std::make_unique<RecurrentSession>(model, 16));
      solo.push_back(std::make_unique<RecurrentSession>(model, 16));
      prompts.push_back(random_tokens(prompt_lengths[i], 40 + i));
    }
    std::vector<size_t> fed(prompts.size(), 0);
    std::vector<int64_t> next(prompts.size(), -1);
    std::vector<std::string> bytes_batched(prompts.size()), bytes_solo(prompts.size());
    double worst = 0;
    for (int64_t step = 0; step < 30; ++step) {
      std::vector<RecurrentSession*> sessions;
      std::vector<std::vector<int64_t>> tokens;
      std::vector<size_t> who;
      for (size_t i = 0; i < prompts.size(); ++i) {
        if (static_cast<int64_t>(i) > step) continue;
        if (fed[i] < prompts[i].size()) {
          const size_t t = std::min<size_t>(16, prompts[i].size() - fed[i]);
          tokens.emplace_back(prompts[i].begin() + fed[i], prompts[i].begin() + fed[i] + t);
        } else {
          tokens.push_back({next[i]});
        }
        sessions.push_back(batched[i].get());
        who.push_back(i);
      }
      const std::vector<torch::Tensor> got = RecurrentSession::step_batch(sessions, tokens);
      ASSERT_EQ(got.size(), who.size());
      for (size_t j = 0; j < who.size(); ++j) {
        const size_t i = who[j];
        const bool prefill = fed[i] < prompts[i].size();
        const torch::Tensor alone = prefill ? solo[i]->prefill(tokens[j]) : solo[i]->decode(tokens[j][0]).unsqueeze(0);
        ASSERT_EQ(got[j].sizes(), alone.sizes());
        worst = std::max(worst, max_abs_diff(got[j], alone));
        if (prefill) fed[i] += tokens[j].size();
        if (fed[i] < prompts[i].size()) continue;
        const int64_t b = got[j][-1].slice(0, 0, 256).argmax().item<int64_t>();
        bytes_batched[i].push_back(static_cast<char>(b));
        bytes_solo[i].push_back(static_cast<char>(alone[-1].slice(0, 0, 256).argmax().item<int64_t>()));
        next[i] = b;
      }
    }
    EXPECT_LE(worst, 1e-5) << impl;  // measured 6e-8 to 9e-8: the rounding of the batched matmuls' other row counts
    for (size_t i = 0; i < prompts.size(); ++i) {
      EXPECT_EQ(bytes_batched[i], bytes_solo[i]) << impl << " session " << i;
      EXPECT_EQ(batched[i]->next_position(), solo[i]->next_position());
      EXPECT_EQ(batched[i]->state_bytes(), solo[i]->state_bytes());
    }
  }
}

TEST(RecurrentSession, RefusesWhatDoesNotFit) {
  Transformer model = flex_model("fused");
  Transformer other = flex_model("fused", 32);
  Transformer softmax = dcp::test::sharp_model(1, Precision::kFp32, 2);
  EXPECT_TRUE(decodes_recurrently(model));
  EXPECT_FALSE(decodes_recurrently(softmax));
  EXPECT_THROW(RecurrentSession(softmax, 16), std::invalid_argument);
  EXPECT_THROW(DecodeSession(model, 16), std::invalid_argument);
  EXPECT_THROW(RecurrentSession(model, 0), std::invalid_argument);
  RecurrentSession a(model, 4), b(model, 4), c(other, 4);
  EXPECT_THROW(a.prefill({}), std::invalid_argument);
  EXPECT_THROW(a.decode(256 + 7), std::invalid_argument);
  EXPECT_THROW(a.decode(-1), std::invalid_argument);
  EXPECT_THROW(a.next_chunk_length(0), std::invalid_argument);
  EXPECT_EQ(a.next_chunk_length(9), 4);
  EXPECT_EQ(a.next_chunk_length(3), 3);
  EXPECT_THROW(RecurrentSession::step_batch({&a, &a}, {{1}, {2}}), std::invalid_argument);
  EXPECT_THROW(RecurrentSession::step_batch({&a, &c}, {{1}, {2}}), std::invalid_argument);
  EXPECT_THROW(RecurrentSession::step_batch({&a, nullptr}, {{1}, {2}}), std::invalid_argument);
  EXPECT_THROW(RecurrentSession::step_batch({&a, &b}, {{1}}), std::invalid_argument);
  EXPECT_THROW(RecurrentSession::step_batch({&a, &b}, {{1}, {1, 2, 3, 4, 5}}), std::invalid_argument);
  EXPECT_THROW(RecurrentSession::step_batch({&a, &b}, {{1}, {}}), std::invalid_argument);
  EXPECT_EQ(a.state_bytes(), 0) << "a refused step changed the states";
  EXPECT_EQ(a.next_position(), 0);
  FlexformerDecoding decoding(3);
  EXPECT_THROW(decoding.set_state(3, {}), std::invalid_argument);
  EXPECT_THROW(decoding.set_state(0, {torch::zeros({1, 4, 17, 8}), torch::Tensor()}), std::invalid_argument);
  EXPECT_THROW(decoding.set_state(0, {torch::zeros({1, 4, 17, 8}), torch::zeros({2, 4, 17})}), std::invalid_argument);
  EXPECT_NO_THROW(decoding.set_state(0, {torch::zeros({2, 4, 17, 8}), torch::zeros({2, 4, 17})}));
  // generate refuses a cache policy for a flexformer model.
  GenerateOptions opt;
  opt.kv_policy = make_kv_policy_with_budget("window", 0.5);
  EXPECT_THROW(generate(model, "ab", opt), std::invalid_argument);
}
