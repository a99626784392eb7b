#include "cli/planning_inputs.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <optional>

#include "cli/commands.h"
#include "dcp/config.h"
#include "dcp/planning.h"

namespace dcp {

namespace fs = std::filesystem;

void add_planning_options(CLI::App* sub, PlanningArgs& a) {
  auto* lengths = sub->add_option("--lengths", a.lengths_file, "file of sample lengths, one integer (tokens) a line")
                      ->check(CLI::ExistingFile);
  auto* workload = sub->add_option("--workload", a.workload,
                                   "built-in workload: opensora-zipf, lognormal, megatron-lognormal (Megatron's "
                                   "dynamic-CP benchmark: its lengths, its rank capacity of 2048 tokens per "
                                   "micro-batch as the memory budget, steps of 16384 tokens per rank), uniform");
  lengths->excludes(workload);
  sub->add_option("--world-size", a.world_size, "ranks (GPUs)")->required()->check(CLI::Range(1, 1 << 20));
  sub->add_option("--cost-model", a.cost_model, "device model: h200 (analytic) or a `dcp profile` JSON file "
                                                "(its fitted time and memory models and its model shape)");
  sub->add_option("--memory-budget-bytes", a.memory_budget_bytes,
                  "per-rank memory budget, bytes (0: --config's memory section, else megatron-lognormal's rank "
                  "capacity, else 0.9 x device memory)")
      ->check(finite_number_validator("bytes", 0, true));  // decimal: CLI11 alone reads 0x10 as 16
  sub->add_option("--config", a.config_path, "dcp config whose model section gives the model shape "
                                             "(default: a 1.3B decoder, hidden 2048, 24 layers, 16 heads, bf16)")
      ->check(CLI::ExistingFile);
  sub->add_option("--samples-per-step", a.samples_per_step, "samples per global step (0: use --tokens-per-step)")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--tokens-per-step", a.tokens_per_step, "token budget of a global step (0: world_size x 131072; megatron-lognormal: x 16384)")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--num-samples", a.num_samples,
                  fmt::format("samples of the lognormal, megatron-lognormal and uniform workloads (at most {})", kMaxNumSamples))
      ->check(CLI::Range(int64_t{1}, kMaxNumSamples));
  sub->add_option("--static-sp", a.static_sp,
                  "SP size of bucket and packed (0: the smallest at which the longest sample fits)")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--mfu", a.mfu, "achieved fraction of the device's peak FLOP/s (default: the device model's own)")->check(finite_number_validator("", 1e-3, false, 1.0));
  sub->add_option("--heads", a.heads, "attention heads of the planned shape (0: its own; hidden must divide)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  sub->add_option("--kv-heads", a.kv_heads,
                  "key/value heads of the planned shape for the cost model (grouped-query attention; 0 = heads, "
                  "default: the shape's own; the trained model has no GQA)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  sub->add_option("--sp-modes", a.sp_modes,
                  "SP modes dcp-opt may choose per group: 'auto' (ulysses, ring and ulysses-ring for softmax "
                  "attention, ulysses for linear) or a comma-separated list of ulysses, ring, ulysses-ring");
  sub->add_option("--max-rounds", a.max_rounds,
                  "dcp-opt: the most rounds a step may have (the ranks repartitioned within a step; 0 = as many as "
                  "pay in the cost model, 1 = one partition per step)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  sub->add_option("--seed", a.seed, "seed of the epoch order and of the generated workload");
  sub->add_flag("--json", a.json, "print JSON");
  sub->allow_extras();
}

PlanningInputs make_planning_inputs(const PlanningArgs& a) {
  if (a.lengths_file.empty() == a.workload.empty()) {
    throw CLI::ValidationError("give exactly one of --lengths FILE or --workload NAME");
  }
  PlanningInputs in;
  if (!a.lengths_file.empty()) {
    std::error_code ec;
    if (!fs::is_regular_file(a.lengths_file, ec)) {  // a FIFO no one writes to would be waited on forever
      throw ConfigError(fmt::format("--lengths '{}' is not a regular file (a FIFO, a device or a socket): give a "
                                    "file of lengths, one integer a line", a.lengths_file));
    }
    in.lengths = read_lengths_file(a.lengths_file);
    in.source = a.lengths_file;
  } else {
    WorkloadOptions w;
    w.name = a.workload;
    w.num_samples = a.num_samples;
    w.seed = a.seed;
    try {
      in.lengths = workload_lengths(w);
    } catch (const std::invalid_argument& e) {
      throw ConfigError(fmt::format("--workload '{}': {}", a.workload, e.what()));
    }
    in.source = a.workload;
  }
  in.samples = samples_from_lengths(in.lengths, in.source);
  DeviceSpec device = [&] {  // first: its error names the known devices
    try {
      return DeviceSpec::named(a.cost_model);
    } catch (const std::invalid_argument& e) {
      // A name that is no file and no path is a bad option value (exit 2); a profile file that is missing or
      // unreadable is a runtime error (exit 1, README).
      std::error_code ec;
      if (a.cost_model.find('/') == std::string::npos && fs::path(a.cost_model).extension() != ".json" &&
          !fs::exists(a.cost_model, ec)) {
        throw ConfigError(fmt::format("--cost-model: {}", e.what()));
      }
      throw;
    }
  }();
  if (a.mfu > 0) device.mfu = a.mfu;
  bool sets_attention = false;
  for (const auto& o : a.overrides) {
    const std::string section = o.substr(2, o.find('.') - 2);
    if ((section != "model" && section != "attention" && section != "memory") ||
        (section == "model" && a.config_path.empty())) {
      throw CLI::ValidationError(fmt::format(
          "override '{}': planning takes the attention and memory sections{}", o,
          a.config_path.empty() ? " (model.* needs --config; the default shape is the 1.3B decoder)"
                                : " and the model section"));
    }
    sets_attention = sets_attention || section == "attention";
  }
  std::vector<std::string> assignments;
  for (const auto& o : a.overrides) assignments.push_back(o.substr(2));
  const Config cfg = Config::load(a.config_path, assignments);
  MemoryConfig memory = cfg.memory;
  // A profile measured one model; its shape, element width (fp32 on the CPU) and attention come with it.
  std::optional<ModelShape> profiled;
  if (a.cost_model != "h200") profiled = MemoryModel::from_profile(a.cost_model, 1.0).shape();
  if (!a.config_path.empty()) {
    in.shape = model_shape_of(cfg, profiled ? profiled->bytes_per_element : 2);
  } else {
    if (profiled) in.shape = *profiled;
    if (sets_attention || !profiled) in.shape = with_attention(in.shape, cfg.attention);
  }
  if (a.heads > 0) {
    if (in.shape.hidden % a.heads != 0) {
      throw ConfigError(fmt::format("--heads {}: must divide the hidden size {}", a.heads, in.shape.hidden));
    }
    in.shape.heads = a.heads;
  }
  if (a.kv_heads >= 0) in.shape.kv_heads = a.kv_heads;
  try {
    in.shape.validate();
  } catch (const std::invalid_argument& e) {
    throw ConfigError(fmt::format("--heads / --kv-heads: {}", e.what()));
  }
  if (a.sp_modes != "auto") {
    for (size_t start = 0; start <= a.sp_modes.size();) {
      const size_t comma = std::min(a.sp_modes.find(',', start), a.sp_modes.size());
      try {
        in.options.sp_modes.push_back(sp_mode_from_name(a.sp_modes.substr(start, comma - start)));
      } catch (const std::invalid_argument& e) {
        throw ConfigError(fmt::format("--sp-modes '{}': {}", a.sp_modes, e.what()));
      }
      start = comma + 1;
    }
  }
  if (a.static_sp > 0) {
    const std::vector<int64_t> allowed = sp_sizes_allowed(a.world_size, in.shape);
    if (a.world_size % a.static_sp != 0 || std::find(allowed.begin(), allowed.end(), a.static_sp) == allowed.end()) {
      throw ConfigError(fmt::format("--static-sp {}: must divide --world-size {} and the model's {} heads",
                                    a.static_sp, a.world_size, in.shape.heads));
    }
  }
  if (a.memory_budget_bytes > 0) memory.budget_bytes = a.memory_budget_bytes;
  in.cost = std::make_unique<CostModel>(in.shape, device);
  try {
    sp_layouts_allowed(a.world_size, *in.cost, in.options.sp_modes);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(fmt::format("--sp-modes '{}': {}", a.sp_modes, e.what()));
  }
  const int64_t longest = in.lengths.empty() ? 0 : *std::max_element(in.lengths.begin(), in.lengths.end());
  in.memory = std::make_unique<MemoryModel>(memory_model_for(a.cost_model, in.shape, device, memory, longest));
  if (const int64_t capacity = workload_rank_capacity_tokens(a.workload); capacity > 0 && memory.budget_bytes <= 0) {
    // The workload's per-rank token capacity (Megatron's max_seqlen_per_dp_cp_rank), unless --memory-budget-bytes
    // or the config set a budget: what one rank holds for a micro-batch of that many tokens without recompute.
    const MemoryModel& m = *in.memory;
    in.memory = std::make_unique<MemoryModel>(m.shape(), m.coefficients(), m.bytes(capacity, 1, 0),
                                              m.longest_sample_tokens());
  }
  in.options.seed = a.seed;
  in.options.samples_per_step = a.samples_per_step;
  in.options.tokens_per_step =
      a.tokens_per_step > 0 ? a.tokens_per_step : a.world_size * workload_tokens_per_rank(a.workload);
  in.options.static_sp_size = a.static_sp;
  in.options.max_rounds = a.max_rounds;
  return in;
}

Planner planner_of_option(const std::string& option, const std::string& name) {
  try {
    return planner_by_name(name);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(fmt::format("{}: {}", option, e.what()));
  }
}

}  // namespace dcp
