// `dcp plan`: print the StepPlans one planner makes for a set of lengths, with predicted times.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>

#include "cli/commands.h"
#include "cli/planning_inputs.h"

namespace dcp {
namespace {

struct PlanArgs : PlanningArgs {
  std::string planner = "dcp-opt";
};

void run_plan(const PlanArgs& a) {
  const Planner planner = planner_of_option("--planner", a.planner);
  const PlanningInputs in = make_planning_inputs(a);
  const PlanSet set = planner(in.samples, a.world_size, *in.cost, *in.memory, in.options);
  if (set.steps.empty() && !in.samples.empty()) {  // as dcp simulate and dcp train: nothing to plan is an error
    throw planner_fits_no_sample(a.planner, in.samples.size(), in.memory->budget_bytes());
  }
  // Skipped samples are counted and named, never dropped silently: the only reason a planner skips one is that it
  // fits no SP size in the per-rank memory budget (dcp/planning.h).
  std::string skipped_line;
  if (!set.skipped_ids.empty()) {
    int64_t shortest = INT64_MAX, longest = 0;
    std::string ids;
    for (size_t i = 0; i < set.skipped_ids.size(); ++i) {
      const int64_t length = in.samples[static_cast<size_t>(set.skipped_ids[i])].length;
      shortest = std::min(shortest, length);
      longest = std::max(longest, length);
      if (i < 10) ids += fmt::format("{}{}", i ? ", " : "", set.skipped_ids[i]);
    }
    const std::string lengths = shortest == longest ? fmt::format("{} tokens", shortest)
                                                    : fmt::format("{} to {} tokens", shortest, longest);
    skipped_line = fmt::format("skipped {} of {} samples ({}; sample ids {}{}, counted from 0 over the lengths in "
                               "order): they fit no SP size within the per-rank planning budget of {:.0f} bytes "
                               "(memory.budget_bytes less memory.margin)",
                               set.skipped_ids.size(), in.samples.size(), lengths, ids,
                               set.skipped_ids.size() > 10 ? ", ..." : "", in.memory->budget_bytes());
  }
  if (a.json) {
    if (!skipped_line.empty()) fmt::print(stderr, "dcp plan: {}\n", skipped_line);
    nlohmann::json out = nlohmann::json::array();
    for (const auto& step : set.steps) out.push_back(nlohmann::json::parse(step.to_json()));
    fmt::print("{}\n", out.dump(1));
    return;
  }
  fmt::print("planner {} on {} ({} samples), world_size {}, cost model {}: {} steps, {} samples skipped\n",
             a.planner, in.source, in.samples.size(), a.world_size, in.cost->device().name, set.steps.size(),
             set.skipped_ids.size());
  if (!skipped_line.empty()) fmt::print("{}\n", skipped_line);
  for (const auto& step : set.steps) {
    const StepCost c = evaluate_step(step, in.samples, a.world_size, *in.cost, *in.memory);
    const double bound = step_lower_bound(step.sample_ids(), in.samples, a.world_size, *in.cost, *in.memory,
                                          planner_sp_modes(a.planner, in.options.sp_modes));
    const int64_t rounds = step.num_rounds();
    fmt::print("\nstep {}: {} tokens, {} round(s), predicted {:.3f} s (lower bound {:.3f} s), imbalance {:.3f}, peak "
               "{:.1f} GB\n",
               step.index, step.global_num_tokens, rounds, c.step_s, bound,
               c.makespan_s > 0 ? 1.0 - c.mean_rank_s / c.makespan_s : 0.0, c.peak_bytes / 1e9);
    for (int64_t r = 0; r < rounds; ++r) {
      const std::string indent = rounds > 1 ? "    " : "  ";
      if (rounds > 1) {
        fmt::print("  round {}: {:.3f} s (its slowest group){}\n", r, c.round_makespan_s[static_cast<size_t>(r)],
                   r > 0 ? fmt::format(", after a switch of {:.6f} s", in.cost->device().round_switch_s) : "");
      }
      for (const auto& g : step.groups) {
        if (g.round != r) continue;
        double seconds = 0;
        int64_t tokens = 0;
        std::string recompute;
        for (const auto& mb : g.micro_batches) {
          std::vector<int64_t> lengths;
          for (int64_t id : mb.sample_ids) lengths.push_back(in.samples[static_cast<size_t>(id)].length);
          seconds += in.cost->seconds(lengths, g.layout(), mb.recompute_layers);
          tokens += mb.num_tokens;
          recompute += (recompute.empty() ? "" : ",") + std::to_string(mb.recompute_layers);
        }
        const std::string mode = g.sp_size == 1 ? ""
                                 : g.sp_mode == SpMode::kUlyssesRing
                                     ? fmt::format(" ulysses-ring (ulysses_size {})", g.ulysses_size)
                                     : fmt::format(" {}", sp_mode_name(g.sp_mode));
        fmt::print("{}ranks [{}, {}) sp_size {}{}: {} micro-batch(es), {} tokens, recompute_layers [{}], {:.3f} s\n",
                   indent, g.first_rank, g.first_rank + g.sp_size, g.sp_size, mode, g.micro_batches.size(), tokens,
                   recompute, seconds);
      }
    }
  }
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto* sub = app.add_subcommand("plan", "Print the StepPlans a planner makes for given sequence lengths");
  auto a = std::make_shared<PlanArgs>();
  add_planning_options(sub, *a);
  sub->add_option("--planner", a->planner, "a planner: bucket, packed, dcp-intra, dcp-inter, dcp-inter-pac or dcp-opt");
  sub->footer("Each step lists its rounds (dcp-opt repartitions the ranks within a step when that pays; "
              "--max-rounds 1 plans one partition), each round its groups. "
              "With --json the output is a plan file (docs/step_plan.md); its sample ids are line numbers "
              "(0-based) of --lengths, or indices of the generated workload. Config overrides --attention.KEY=VALUE (e.g. "
              "--attention.backend=flexformer), --memory.KEY=VALUE and, with --config, --model.KEY=VALUE set the "
              "planned model.");
  sub->callback([sub, a] {
    a->overrides = config_overrides(*sub);
    run_plan(*a);
  });
}

}  // namespace dcp
