// `dcp simulate`: every planner plans the epoch, each step is validated and predicted, and the predictions are
// compared (markdown or JSON on stdout).
#include "tools/simulate.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>
#include <stdexcept>
#include <tuple>

namespace dcp {
namespace {

// A group's round, SP size and mode: (round, sp_size, mode name, ulysses_size of ulysses-ring else 0); mode "-"
// for sp 1.
using SizeMode = std::tuple<int64_t, int64_t, std::string, int64_t>;

SizeMode size_mode_of(const GroupPlan& g) {
  if (g.sp_size == 1) return {g.round, 1, "-", 0};
  return {g.round, g.sp_size, sp_mode_name(g.sp_mode), g.sp_mode == SpMode::kUlyssesRing ? g.ulysses_size : 0};
}

// What a planner's groups of one SP size and mode ran over the epoch.
struct SizeUse {
  int64_t groups = 0, micro_batches = 0, samples = 0, tokens = 0, recompute_layers = 0;  // recompute: summed over mbs
};

struct Row {
  std::string planner;
  double epoch_s = 0, lower_bound_s = 0, mean_imbalance = 0, plan_ms_per_step = 0, peak_gb = 0;
  int64_t steps = 0, trained = 0, skipped = 0;
  int64_t rounds = 0, steps_with_rounds = 0;  // rounds over all steps; steps of more than one round
  std::set<int64_t> sp_sizes;  // of groups that ran micro-batches
  std::map<SizeMode, SizeUse> by_sp_size;
};

// Plans with one planner, checks every step against the samples, and predicts its epoch.
Row simulate(const std::string& name, const std::vector<Sample>& samples, int64_t world, const CostModel& cost,
             const MemoryModel& memory, const PlannerOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  const PlanSet set = planner_by_name(name)(samples, world, cost, memory, opt);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  Row row;
  row.planner = name;
  row.steps = static_cast<int64_t>(set.steps.size());
  row.skipped = static_cast<int64_t>(set.skipped_ids.size());
  row.plan_ms_per_step = row.steps > 0 ? ms / static_cast<double>(row.steps) : 0.0;
  std::vector<int> seen(samples.size(), 0);
  double imbalance = 0;
  for (const auto& step : set.steps) {
    step.validate(world, samples, cost.shape().layers);
    const std::vector<int64_t> ids = step.sample_ids();
    for (const auto& g : step.groups) {
      if (g.micro_batches.empty()) continue;
      row.sp_sizes.insert(g.sp_size);
      SizeUse& use = row.by_sp_size[size_mode_of(g)];
      ++use.groups;
      for (const auto& mb : g.micro_batches) {
        ++use.micro_batches;
        use.samples += static_cast<int64_t>(mb.sample_ids.size());
        use.tokens += mb.num_tokens;
        use.recompute_layers += mb.recompute_layers;
      }
    }
    for (int64_t id : ids) ++seen[static_cast<size_t>(id)];
    row.rounds += step.num_rounds();
    row.steps_with_rounds += step.num_rounds() > 1 ? 1 : 0;
    const StepCost c = evaluate_step(step, samples, world, cost, memory);
    if (c.peak_bytes > memory.budget_bytes()) {
      throw std::runtime_error(fmt::format("planner {} step {}: predicted peak {:.1f} GB exceeds the budget {:.1f} GB",
                                           name, step.index, c.peak_bytes / 1e9, memory.budget_bytes() / 1e9));
    }
    row.epoch_s += c.step_s;
    row.lower_bound_s += step_lower_bound(ids, samples, world, cost, memory, planner_sp_modes(name, opt.sp_modes));
    row.peak_gb = std::max(row.peak_gb, c.peak_bytes / 1e9);
    imbalance += c.makespan_s > 0 ? 1.0 - c.mean_rank_s / c.makespan_s : 0.0;
  }
  for (int64_t id : set.skipped_ids) ++seen[static_cast<size_t>(id)];
  for (size_t i = 0; i < seen.size(); ++i) {
    if (seen[i] != 1) {
      throw std::runtime_error(fmt::format("planner {}: sample {} is planned {} times", name, i, seen[i]));
    }
  }
  row.trained = static_cast<int64_t>(samples.size()) - row.skipped;
  row.mean_imbalance = row.steps > 0 ? imbalance / static_cast<double>(row.steps) : 0.0;
  return row;
}

}  // namespace

ConfigError planner_fits_no_sample(const std::string& planner, size_t samples, double budget_bytes) {
  return ConfigError(fmt::format(
      "planner {} fits none of the {} samples in the per-rank planning budget of {} bytes (memory.budget_bytes "
      "less memory.margin): raise memory.budget_bytes (--memory-budget-bytes) or memory.fraction, or lower "
      "memory.margin",
      planner, samples, budget_bytes));
}

void run_simulation(const PlanningInputs& in, const std::vector<std::string>& names, int64_t world_size,
                    bool native_iterations, bool by_sp_size, bool json) {
  const auto& samples = in.samples;
  const auto& lengths = in.lengths;
  const auto& source = in.source;
  const CostModel& cost = *in.cost;
  const MemoryModel& memory = *in.memory;
  PlannerOptions opt = in.options;
  opt.native_iterations = native_iterations;
  const DeviceSpec& device = cost.device();

  std::vector<Row> rows;
  for (const auto& name : names) {
    rows.push_back(simulate(name, samples, world_size, cost, memory, opt));
  }
  for (const auto& r : rows) {
    // Nothing to compare: every ratio below would be 0 / 0.
    if (r.trained == 0) {
      throw planner_fits_no_sample(r.planner, samples.size(), memory.budget_bytes());
    }
  }
  double bucket_s = 0;
  for (const auto& r : rows) {
    if (r.planner == "bucket") bucket_s = r.epoch_s;
  }
  if (bucket_s == 0) bucket_s = simulate("bucket", samples, world_size, cost, memory, opt).epoch_s;

  int64_t tokens = 0;
  for (int64_t l : lengths) tokens += l;
  if (json) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& r : rows) {
      out.push_back({{"planner", r.planner},
                     {"predicted_epoch_s", r.epoch_s},
                     {"lower_bound_s", r.lower_bound_s},
                     {"mean_imbalance", r.mean_imbalance},
                     {"speedup_vs_bucket", bucket_s / r.epoch_s},
                     {"lower_bound_ratio", r.lower_bound_s / r.epoch_s},
                     {"plan_ms_per_step", r.plan_ms_per_step},
                     {"samples_trained", r.trained},
                     {"samples_skipped", r.skipped},
                     {"steps", r.steps},
                     {"peak_memory_gb", r.peak_gb},
                     {"rounds_per_step", r.steps > 0 ? static_cast<double>(r.rounds) / static_cast<double>(r.steps) : 0.0},
                     {"steps_with_rounds", r.steps_with_rounds},
                     {"sp_sizes", r.sp_sizes}});
      if (by_sp_size) {
        nlohmann::json uses = nlohmann::json::array();
        for (const auto& [key, u] : r.by_sp_size) {
          const auto& [round, sp, mode, ulysses] = key;
          uses.push_back({{"round", round}, {"sp_size", sp}, {"sp_mode", mode}, {"ulysses_size", ulysses}, {"groups", u.groups}, {"micro_batches", u.micro_batches},
                          {"samples", u.samples}, {"tokens", u.tokens},
                          {"mean_recompute_layers", static_cast<double>(u.recompute_layers) / u.micro_batches}});
        }
        out.back()["by_sp_size"] = uses;
      }
    }
    fmt::print("{}\n", out.dump(2));
    return;
  }
  fmt::print("workload {}: {} samples, {} tokens (max {}); world_size {}; cost model {} ({:.2g}-parameter decoder, "
             "{} attention, mfu {}, budget {:.1f} GB); steps of {}{}\n\n",
             source, samples.size(), tokens, *std::max_element(lengths.begin(), lengths.end()), world_size,
             device.name, in.shape.params(), attention_kind_name(in.shape.attention), device.mfu,
             memory.budget_bytes() / 1e9,
             opt.samples_per_step > 0 ? fmt::format("{} samples", opt.samples_per_step)
                                      : fmt::format("<= {} tokens", opt.tokens_per_step),
             opt.native_iterations ? "; dcp-intra, dcp-inter, dcp-inter-pac: their own iterations" : "");
  fmt::print("| planner | predicted_epoch_s | mean_imbalance | speedup_vs_bucket | lower_bound_ratio | "
             "plan_ms_per_step | samples_trained | samples_skipped | steps | rounds_per_step | steps_with_rounds | "
             "peak_memory_gb | sp_sizes |\n");
  fmt::print("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& r : rows) {
    fmt::print("| {} | {:.1f} | {:.3f} | {:.2f} | {:.3f} | {:.2f} | {} | {} | {} | {:.2f} | {} | {:.1f} | {} |\n",
               r.planner, r.epoch_s, r.mean_imbalance, bucket_s / r.epoch_s, r.lower_bound_s / r.epoch_s,
               r.plan_ms_per_step, r.trained, r.skipped, r.steps,
               r.steps > 0 ? static_cast<double>(r.rounds) / static_cast<double>(r.steps) : 0.0, r.steps_with_rounds,
               r.peak_gb, fmt::join(r.sp_sizes, ","));
  }
  if (!by_sp_size) return;
  fmt::print("\n| planner | round | sp_size | sp_mode | ulysses_size | groups | micro_batches | samples | tokens | "
             "token_share | mean_recompute_layers |\n");
  fmt::print("|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& r : rows) {
    for (const auto& [key, u] : r.by_sp_size) {
      const auto& [round, sp, mode, ulysses] = key;
      fmt::print("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.3f} | {:.2f} |\n", r.planner, round, sp, mode,
                 ulysses > 0 ? std::to_string(ulysses) : "-", u.groups, u.micro_batches,
                 u.samples, u.tokens, static_cast<double>(u.tokens) / static_cast<double>(tokens),
                 static_cast<double>(u.recompute_layers) / static_cast<double>(u.micro_batches));
    }
  }
}

}  // namespace dcp
