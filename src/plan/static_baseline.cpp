#include "plan/static_baseline.h"

#include <fmt/format.h>

#include <stdexcept>

#include "dcp/planners.h"

namespace dcp {

StaticBaselines::StaticBaselines(int64_t world_size, const CostModel& cost, const MemoryModel& memory)
    : world_size_(world_size), cost_(cost), memory_(memory) {
  for (int64_t s : sp_sizes_allowed(world_size, cost.shape())) {
    if (world_size % s == 0) sp_sizes_.push_back(s);
  }
}

void StaticBaselines::add_step(const std::vector<int64_t>& ids, const std::vector<Sample>& samples) {
  if (ids.empty()) return;
  // The planners want dense ids; one step holds every sample of the step.
  std::vector<Sample> step_samples;
  for (int64_t id : ids) {
    Sample s = samples[static_cast<size_t>(id)];
    s.id = static_cast<int64_t>(step_samples.size());
    step_samples.push_back(std::move(s));
  }
  PlannerOptions options;
  options.samples_per_step = static_cast<int64_t>(step_samples.size());
  for (int64_t sp : sp_sizes_) {
    options.static_sp_size = sp;
    for (const auto& [name, planner] : {std::pair{"packed", &plan_packed}, std::pair{"bucket", &plan_bucket}}) {
      const std::string layout = fmt::format("{} sp {}", name, sp);
      if (infeasible_.count(layout) != 0) continue;
      PlanSet set;
      try {
        set = planner(step_samples, world_size_, cost_, memory_, options);
      } catch (const std::invalid_argument&) {  // e.g. no recompute count fits this SP size
        infeasible_.insert(layout);
        continue;
      }
      if (!set.skipped_ids.empty() || set.steps.size() != 1) {
        infeasible_.insert(layout);
        continue;
      }
      total_s_[layout] += evaluate_step(set.steps[0], step_samples, world_size_, cost_, memory_).step_s;
    }
  }
}

std::optional<StaticBaselines::Best> StaticBaselines::best() const {
  std::optional<Best> out;
  for (const auto& [layout, s] : total_s_) {
    if (infeasible_.count(layout) != 0) continue;
    if (!out || s < out->predicted_s) out = Best{layout, s};
  }
  return out;
}

}  // namespace dcp
