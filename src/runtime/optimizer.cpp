// The optimizer of dcp's own model and the intra-op threads of a rank (src/runtime/optimizer.h).
#include "runtime/optimizer.h"

#include <torch/optim/adamw.h>

#include <algorithm>
#include <thread>

namespace dcp {

std::unique_ptr<torch::optim::AdamW> make_optimizer(Transformer& model, const TrainConfig& cfg) {
  // Decay matrices only; norms' gains are left alone, as in GPT-style training.
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : model->parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  auto opts = [&](double wd) {
    return std::make_unique<torch::optim::AdamWOptions>(
        torch::optim::AdamWOptions(cfg.lr).betas({cfg.beta1, cfg.beta2}).weight_decay(wd));
  };
  std::vector<torch::optim::OptimizerParamGroup> param_groups;
  param_groups.emplace_back(decay, opts(cfg.weight_decay));
  param_groups.emplace_back(no_decay, opts(0.0));
  return std::make_unique<torch::optim::AdamW>(param_groups, torch::optim::AdamWOptions(cfg.lr));
}

int64_t threads_per_rank(const TrainConfig& cfg, const DistEnv& env) {
  return cfg.threads > 0 ? cfg.threads
                         : std::max<int64_t>(1, std::thread::hardware_concurrency() / env.local_world_size);
}

}  // namespace dcp
