// Options shared by `dcp plan` and `dcp simulate`: the lengths to plan, the model shape, the device model.
#pragma once

#include <CLI/CLI.hpp>

#include <memory>
#include <string>
#include <vector>

#include "dcp/planners.h"
#include "tools/simulate.h"

namespace dcp {

struct PlanningArgs {
  std::string lengths_file, workload, cost_model = "h200", config_path;
  int64_t world_size = 0, samples_per_step = 0, tokens_per_step = 0, num_samples = 8000, static_sp = 0;
  uint64_t seed = 1234;
  double mfu = 0;  // 0 = the device model's own
  int64_t heads = 0, kv_heads = -1;  // 0 / -1 = the shape's own
  std::string sp_modes = "auto";     // PlannerOptions::sp_modes: "auto" or a comma-separated list
  int64_t max_rounds = 0;            // PlannerOptions::max_rounds (dcp-opt): 0 = as many as pay
  double memory_budget_bytes = 0;  // 0 = the --config's memory section (default 0.9 x device memory)
  bool json = false;
  std::vector<std::string> overrides;  // --section.key=value for the model, attention and memory sections
};


/// Registers --lengths/--workload, --world-size, --cost-model, --config, step sizes, --static-sp, --mfu,
/// --heads, --kv-heads, --sp-modes, --max-rounds, --seed and --json on `sub`, and lets it take config overrides (the command stores config_overrides(*sub)
/// in `overrides`). Every number option is bounded (--num-samples by kMaxNumSamples).
void add_planning_options(CLI::App* sub, PlanningArgs& a);

/// Reads or generates the lengths and builds the models. The model shape is the 1.3B default unless --config
/// names a dcp config, whose model and attention sections then give it (model_shape_of: SwiGLU, byte
/// vocabulary). With --cost-model a `dcp profile` file, the shape is the profiled model's (its element width
/// and attention too; --config must describe the same model) and the memory model is the profile's fitted one,
/// with the longest given length bounding a sample. Overrides apply to --config (or the defaults); without
/// --config, attention.* overrides set the attention of the default or profiled shape (with_attention), e.g.
/// --attention.backend=flexformer plans the 1.3B decoder with Flexformer attention. The per-rank budget is
/// --memory-budget-bytes, else the memory section's memory.budget_bytes / memory.fraction (memory_budget_bytes
/// in dcp/planning.h). --heads and --kv-heads then set the shape's heads and ModelShape::kv_heads (the cost
/// model's GQA; the trained model has none); --sp-modes the modes dcp-opt may choose. Throws CLI::ValidationError unless exactly one of --lengths/--workload is given, for an
/// override outside the model, attention and memory sections and for a model.* override without --config;
/// ConfigError for a bad override, an unknown --workload or --cost-model name and a --static-sp that does not
/// divide the world size and the heads; and what the readers and models throw.
PlanningInputs make_planning_inputs(const PlanningArgs& a);

/// planner_by_name(name), with an unknown name a usage error naming `option` (ConfigError, exit 2).
Planner planner_of_option(const std::string& option, const std::string& name);

/// The largest --num-samples: the generated lengths and the planners' tables grow with it (a typo such as
/// 9223372036854775807 would allocate until memory runs out).
inline constexpr int64_t kMaxNumSamples = 10'000'000;

}  // namespace dcp
