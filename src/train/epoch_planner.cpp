// The trainer's planning phase (src/train/epoch_planner.h).
#include "train/epoch_planner.h"

#include <spdlog/spdlog.h>

#include "dcp/dist.h"

namespace dcp {

EpochPlanner::EpochPlanner(const TrainConfig& train, const ParallelConfig& parallel, const ModelConfig& model,
                           uint64_t seed, int64_t world_size, const Corpus& corpus,
                           const std::vector<int64_t>& train_lengths, const RunCostModels& models,
                           std::vector<StepPlan> file_plans)
    : corpus_(corpus),
      models_(models),
      file_plans_(std::move(file_plans)),
      planner_(train.planner),
      name_(file_plans_.empty() ? train.planner : "plan-file"),
      seed_(seed),
      world_size_(world_size),
      global_batch_tokens_(train.global_batch_tokens),
      max_rounds_(train.max_rounds) {
  const int64_t longest = length_histogram(train_lengths).max;
  // A ring shards the sequence without sharding heads, so every size of parallel.sp_sizes serves it.
  const SpMode sp_mode = sp_mode_from_name(parallel.sp_mode);
  const std::vector<int64_t> sp_sizes = sp_mode == SpMode::kRing
                                            ? resolve_sp_sizes(parallel.sp_sizes, world_size)
                                            : usable_sp_sizes(parallel.sp_sizes, world_size, model.kv_heads());
  needs_ = memory_needs(models.memory, sp_sizes, longest);
  spdlog::info("memory: one sample of {}", describe_memory_needs(needs_));
  dp_ = DataParallelOptions{world_size, train.global_batch_tokens, train.micro_batch_tokens, model.recompute_layers,
                            parallel.sp_size, sp_mode,
                            sp_mode == SpMode::kUlyssesRing
                                ? ulysses_ring_size(parallel.sp_size, parallel.ulysses_size, model.kv_heads())
                                : 0};
  if (train.planner == "static" && parallel.sp_size == 0) {
    const StaticSizing sizing = size_static_planner(dp_, models.memory, sp_sizes, train_lengths);
    dp_ = sizing.options;
    static_max_sample_tokens_ = sizing.max_sample_tokens;
    spdlog::info("static planner sized to the longest sample that fits ({} tokens of the longest {}): sp {}, {} "
                 "recomputed layers, micro-batches of up to {} tokens per rank",
                 sizing.longest.length, longest, dp_.sp_size, dp_.recompute_layers, dp_.micro_batch_tokens);
  }
}

std::vector<StepPlan> EpochPlanner::plans(int64_t epoch) {
  if (!file_plans_.empty()) return file_plans_;
  PlanSet set;
  if (planner_ == "static") {
    std::vector<int64_t> kept;
    for (int64_t id : epoch_order(corpus_.train_ids(), seed_, epoch)) {
      const bool fits = corpus_.samples()[static_cast<size_t>(id)].length <= static_max_sample_tokens_;
      (fits ? kept : set.skipped_ids).push_back(id);
    }
    set.steps = plan_data_parallel(corpus_.samples(), kept, epoch, dp_);
  } else {
    PlannerOptions opt;
    opt.seed = seed_;
    opt.tokens_per_step = global_batch_tokens_;
    opt.max_rounds = max_rounds_;
    set = plan_training_epoch(planner_, corpus_.samples(), corpus_.train_ids(), epoch, world_size_, models_.cost,
                              models_.memory, opt);
  }
  if (!set.skipped_ids.empty()) {
    const Sample& example = corpus_.samples()[static_cast<size_t>(set.skipped_ids[0])];
    spdlog::warn("planner {} skips {} sample(s) of epoch {}: longer than the memory budget admits at any SP size "
                 "with every layer recomputed (e.g. {}, {} tokens)",
                 planner_, set.skipped_ids.size(), epoch, example.source, example.length);
    skipped_["exceeds_memory_budget"] += static_cast<int64_t>(set.skipped_ids.size());
  }
  return set.steps;
}

}  // namespace dcp
