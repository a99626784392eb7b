// A random-weight sanity check of the KV-cache compression policies (not an evaluation: `dcp kv-eval` on a
// trained model is that): a tiny random model with peaked attention (q and k rows of wqkv scaled by 8, as the KV
// cache tests do) reads a random byte sequence teacher-forced, prompt prefilled in chunks, the rest decoded one
// token at a time, once through the full cache and once per policy and budget. Prints, over the decoded tokens,
// the mean KL(full || policy) of the next-token distributions, the mean and largest |logit difference|, how
// often the argmax agrees, and the cache's bytes at the end against the full cache's.
//
//   build/bench/bench_kv_policies --tokens 1000 --prompt-tokens 64 --seed 1
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <string>
#include <vector>

#include "dcp/infer.h"
#include "dcp/kv_policies.h"

namespace {

using namespace dcp;

Transformer sharp_model(uint64_t seed) {
  ModelConfig cfg;
  cfg.d_model = 64;
  cfg.n_layers = 3;
  cfg.n_heads = 4;
  cfg.d_ff = 128;
  torch::manual_seed(seed);
  Transformer model(cfg, AttentionConfig{}, Precision::kFp32);
  torch::NoGradGuard no_grad;
  for (const auto& item : model->named_parameters()) {
    if (item.key().find("wqkv") != std::string::npos) item.value().narrow(0, 0, 2 * cfg.d_model).mul_(8.0);
  }
  model->eval();
  return model;
}

struct Run {
  torch::Tensor logits;  // [decoded tokens, vocab]
  int64_t bytes;
};

Run teacher_forced(Transformer& model, const std::vector<int64_t>& tokens, int64_t prompt, int64_t chunk,
                   std::shared_ptr<KvPolicy> policy) {
  DecodeSession session(model, chunk, std::move(policy));
  session.prefill(std::vector<int64_t>(tokens.begin(), tokens.begin() + prompt));
  std::vector<torch::Tensor> rows;
  for (size_t i = static_cast<size_t>(prompt); i < tokens.size(); ++i) rows.push_back(session.decode(tokens[i]));
  return {torch::stack(rows), session.cache().bytes()};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("KV-cache policies against the full cache on a tiny random model (a sanity check)");
  int64_t tokens_n = 1000, prompt = 64, chunk = 16, seed = 1;
  std::vector<double> budgets{0.25, 0.5};
  app.add_option("--tokens", tokens_n, "sequence length")->check(CLI::Range(2, 1 << 20));
  app.add_option("--prompt-tokens", prompt, "prefilled tokens")->check(CLI::Range(1, 1 << 20));
  app.add_option("--chunk-tokens", chunk, "prefill chunk")->check(CLI::Range(1, 1 << 20));
  app.add_option("--budgets", budgets, "budget ratios in (0, 1]")->check(CLI::Range(1e-6, 1.0));
  app.add_option("--seed", seed, "model and sequence seed");
  CLI11_PARSE(app, argc, argv);
  if (prompt >= tokens_n) {
    fmt::print(stderr, "--prompt-tokens {} must be below --tokens {}\n", prompt, tokens_n);
    return 2;
  }
  torch::set_num_threads(1);
  Transformer model = sharp_model(static_cast<uint64_t>(seed));
  torch::manual_seed(static_cast<uint64_t>(seed) + 1);
  const torch::Tensor t = torch::randint(0, 256, {tokens_n}, torch::kInt64);
  std::vector<int64_t> tokens(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + tokens_n);
  tokens[0] = kBosToken;

  const Run full = teacher_forced(model, tokens, prompt, chunk, nullptr);
  const torch::Tensor full_logp = torch::log_softmax(full.logits, 1);
  fmt::print("| policy | budget | mean KL(full, policy) nats | mean abs logit diff | max abs logit diff | argmax agrees | bytes / full |\n");
  fmt::print("|---|---|---|---|---|---|---|\n");
  for (const char* name : {"window", "h2o", "snapkv", "tova", "expected-attention", "adakv-snapkv",
                           "adakv-expected-attention", "minimax"}) {
    for (double budget : budgets) {
      const Run run = teacher_forced(model, tokens, prompt, chunk, make_kv_policy(name, {{"budget", budget}}));
      const torch::Tensor logp = torch::log_softmax(run.logits, 1);
      const double kl = (full_logp.exp() * (full_logp - logp)).sum(1).mean().item<double>();
      const torch::Tensor diff = (run.logits - full.logits).abs();
      const double agree = (run.logits.argmax(1) == full.logits.argmax(1)).to(torch::kDouble).mean().item<double>();
      fmt::print("| {} | {} | {:.4f} | {:.4f} | {:.3f} | {:.1f}% | {:.3f} |\n", name, budget, kl,
                 diff.mean().item<double>(), diff.max().item<double>(), 100 * agree,
                 static_cast<double>(run.bytes) / static_cast<double>(full.bytes));
    }
  }
  return 0;
}
