// Planner registry, step evaluation and the lower bound.
#include "dcp/planners.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <stdexcept>

#include "plan/planner_common.h"

namespace dcp {

using namespace planner_detail;

std::vector<std::string> planner_names() {
  return {"bucket", "packed", "dcp-intra", "dcp-inter", "dcp-inter-pac", "dcp-opt"};
}

Planner planner_by_name(const std::string& name) {
  if (name == "bucket") return plan_bucket;
  if (name == "packed") return plan_packed;
  if (name == "dcp-intra") return plan_dcp_intra;
  if (name == "dcp-inter") return plan_dcp_inter;
  if (name == "dcp-inter-pac") return plan_dcp_inter_pac;
  if (name == "dcp-opt") return plan_dcp_opt;
  throw std::invalid_argument(fmt::format("unknown planner '{}' (known: {})", name, fmt::join(planner_names(), ", ")));
}

StepCost evaluate_step(const StepPlan& plan, const std::vector<Sample>& samples, int64_t world_size,
                       const CostModel& cost, const MemoryModel& memory) {
  StepCost c;
  double busy = 0;
  for (const auto& g : plan.groups) {
    double t = 0;
    for (const auto& mb : g.micro_batches) {
      std::vector<int64_t> lengths;
      for (int64_t id : mb.sample_ids) lengths.push_back(samples.at(static_cast<size_t>(id)).length);
      t += cost.seconds(lengths, g.layout(), mb.recompute_layers);
      c.peak_bytes = std::max(c.peak_bytes, memory.bytes(mb.num_tokens, g.sp_size, mb.recompute_layers));
    }
    c.makespan_s = std::max(c.makespan_s, t);
    busy += t * static_cast<double>(g.sp_size);
  }
  c.mean_rank_s = busy / static_cast<double>(world_size);
  c.step_s = c.makespan_s + cost.step_seconds(world_size);
  return c;
}

double step_lower_bound(const std::vector<int64_t>& ids, const std::vector<Sample>& samples, int64_t world_size,
                        const CostModel& cost, const MemoryModel& memory, const std::vector<SpMode>& modes) {
  check_world(world_size);
  const auto layouts = sp_layouts_allowed(world_size, cost, modes);
  const int64_t L = cost.shape().layers;
  const double overhead = cost.device().micro_batch_overhead_s;
  double sum_gpu_s = 0, longest = 0;
  for (int64_t id : ids) {
    const int64_t len = samples.at(static_cast<size_t>(id)).length;
    double g = kInf, f = kInf;
    for (const SpLayout& l : layouts) {
      const int64_t s = l.sp_size;
      auto r = memory.min_recompute_layers(len, s);
      if (!r) continue;
      const double per_mb = overhead * static_cast<double>(len) / static_cast<double>(memory.max_tokens(s, L));
      g = std::min(g, static_cast<double>(s) * (cost.work_seconds(len, l, *r) + per_mb));
      f = std::min(f, cost.seconds({len}, l, *r));
    }
    if (g == kInf) continue;
    sum_gpu_s += g;
    longest = std::max(longest, f);
  }
  return std::max(sum_gpu_s / static_cast<double>(world_size), longest) + cost.step_seconds(world_size);
}

}  // namespace dcp
