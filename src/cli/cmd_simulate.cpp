// `dcp simulate`: plan an epoch with each planner under the analytic cost model and compare predicted times.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <map>
#include <set>
#include <stdexcept>
#include <tuple>

#include "cli/commands.h"
#include "cli/planning_inputs.h"

namespace dcp {
namespace {

struct SimulateArgs : PlanningArgs {
  std::string planners = "all";
  bool by_sp_size = false;
  bool native_iterations = false;
};

std::vector<std::string> split_names(const std::string& list) {
  if (list == "all") return planner_names();
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = std::min(list.find(',', start), list.size());
    out.push_back(list.substr(start, comma - start));
    planner_of_option(fmt::format("--planners '{}'", list), out.back());  // a usage error for an unknown name
    start = comma + 1;
  }
  return out;
}

void run_simulate(const SimulateArgs& a) {
  const std::vector<std::string> names = split_names(a.planners);  // before the inputs: a typo fails at once
  const PlanningInputs in = make_planning_inputs(a);
  run_simulation(in, names, a.world_size, a.native_iterations, a.by_sp_size, a.json);
}

}  // namespace

void add_simulate_command(CLI::App& app) {
  auto* sub = app.add_subcommand("simulate", "Plan an epoch with each planner and compare predicted epoch times");
  auto a = std::make_shared<SimulateArgs>();
  add_planning_options(sub, *a);
  sub->add_option("--planners", a->planners, "'all' or a comma-separated list of bucket, packed, dcp-intra, dcp-inter, dcp-inter-pac, dcp-opt");
  sub->add_flag("--native-iterations", a->native_iterations,
                "dcp-intra, dcp-inter and dcp-inter-pac form their own iterations as the reference does (their "
                "steps column counts them) instead of planning the common steps; see PlannerOptions");
  sub->add_flag("--by-sp-size", a->by_sp_size,
                "also report, per planner, round index, SP size and SP mode (ulysses, ring, ulysses-ring with "
                "its ulysses_size; '-' for sp 1), the groups (counted per round), micro-batches, samples, tokens "
                "and mean recompute_layers of its plans");
  sub->footer("Config overrides --attention.KEY=VALUE (e.g. --attention.backend=flexformer), --memory.KEY=VALUE "
              "and, with --config, --model.KEY=VALUE set the planned model. "
              "Every plan is validated (groups partition the ranks, every sample exactly once, memory within the "
              "budget). speedup_vs_bucket = bucket's predicted epoch (with the same --static-sp) / this planner's; "
              "lower_bound_ratio = lower bound / predicted epoch (1 is optimal).");
  sub->callback([sub, a] {
    a->overrides = config_overrides(*sub);
    run_simulate(*a);
  });
}

}  // namespace dcp
