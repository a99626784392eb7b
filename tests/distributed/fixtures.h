// Shared set-up of the multi-process tests: the process groups of this rank, a tiny model and corpus.
#pragma once

#include "dcp/step_runner.h"
#include "dcp/trainer.h"

namespace dcp::test {

/// Groups for every divisor of the world size, created once per test process.
inline const ProcessGroups& groups() {
  static ProcessGroups g(DistEnv::from_environment(), 30.0,
                         resolve_sp_sizes("all", DistEnv::from_environment().world_size));
  return g;
}

inline Config tiny_config(const std::vector<std::string>& extra = {}) {
  std::vector<std::string> o = {"--model.d_model=32",          "--model.n_layers=3",
                                "--model.n_heads=4",           "--model.d_ff=64",
                                "--data.max_seq_len=48",       "--train.micro_batch_tokens=100",
                                "--train.global_batch_tokens=400"};
  o.insert(o.end(), extra.begin(), extra.end());
  return Config::load("", o);
}

/// Twelve documents of lengths 7, 20, 33, ... bytes (several odd), some split into chunks of 48.
inline Corpus tiny_corpus(const Config& cfg) {
  std::vector<std::pair<std::string, std::string>> docs;
  for (int i = 0; i < 12; ++i) {
    std::string text;
    for (int j = 0; j < 7 + 13 * i; ++j) text.push_back(static_cast<char>('a' + (i * 7 + j * 3) % 26));
    docs.emplace_back("doc" + std::to_string(i), text);
  }
  return Corpus::from_documents(docs, cfg.data);
}

inline Transformer fresh_model(const Config& cfg) {
  torch::manual_seed(42);
  return Transformer(cfg.model, cfg.attention);
}

/// Runs `plan` distributed and checks the gradients against the single-process reference on this rank.
inline void expect_step_matches_reference(const Config& cfg, const Corpus& corpus, const StepPlan& plan) {
  Transformer model = fresh_model(cfg);
  StepStats r = compute_step_gradients(model, corpus, plan, groups());
  Transformer reference = fresh_model(cfg);
  double ref_loss = reference_step_gradients(reference, corpus, plan);
  GradientComparison c = compare_gradients(model, reference);
  EXPECT_LT(c.max_rel_err, 1e-5) << "max abs err " << c.max_abs_err << ", max |grad| " << c.max_abs_ref;
  EXPECT_NEAR(r.loss, ref_loss, 1e-5 * ref_loss);
}

}  // namespace dcp::test
