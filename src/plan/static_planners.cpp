// `packed` and `bucket`: one SP size and recompute count for the whole epoch.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>

#include "dcp/planners.h"
#include "plan/planner_common.h"

namespace dcp {

using namespace planner_detail;

PlanSet plan_packed(const std::vector<Sample>& samples, int64_t world_size, const CostModel& cost,
                    const MemoryModel& memory, const PlannerOptions& options) {
  check_world(world_size);
  const auto steps = split_steps(samples, options);
  const StaticSetting st = static_setting(samples, world_size, cost, memory, options.static_sp_size);
  PlanSet out;
  out.skipped_ids = skipped_ids(st.skipped);
  if (st.sp_size == 0) return out;
  const int64_t n_groups = world_size / st.sp_size;
  for (const auto& step : steps) {
    auto ids = kept(step, st.skipped);
    if (ids.empty()) continue;
    std::stable_sort(ids.begin(), ids.end(),
                     [&](int64_t a, int64_t b) { return length_of(samples, a) > length_of(samples, b); });
    std::vector<std::vector<int64_t>> per_group(static_cast<size_t>(n_groups));
    std::vector<double> load(static_cast<size_t>(n_groups), 0.0);
    for (int64_t id : ids) {
      const auto g = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      per_group[g].push_back(id);
      load[g] += cost.seconds({length_of(samples, id)}, st.sp_size, st.recompute_layers);
    }
    std::vector<GroupPlan> groups;
    for (int64_t g = 0; g < n_groups; ++g) {
      groups.push_back(GroupPlan{g * st.sp_size, st.sp_size,
                                 pack_first_fit(samples, per_group[static_cast<size_t>(g)], st.capacity,
                                                st.recompute_layers)});
    }
    out.steps.push_back(make_step(options, static_cast<int64_t>(out.steps.size()), std::move(groups)));
  }
  return out;
}

PlanSet plan_bucket(const std::vector<Sample>& samples, int64_t world_size, const CostModel& cost,
                    const MemoryModel& memory, const PlannerOptions& options) {
  check_world(world_size);
  const auto steps = split_steps(samples, options);
  const StaticSetting st = static_setting(samples, world_size, cost, memory, options.static_sp_size);
  PlanSet out;
  out.skipped_ids = skipped_ids(st.skipped);
  if (st.sp_size == 0) return out;
  const int64_t n_groups = world_size / st.sp_size;
  for (const auto& step : steps) {
    const auto ids = kept(step, st.skipped);
    if (ids.empty()) continue;
    std::map<int64_t, std::vector<int64_t>> buckets;  // quarter-octave index -> ids in step order
    for (int64_t id : ids) buckets[length_bucket(length_of(samples, id))].push_back(id);
    std::vector<MicroBatch> mbs;
    for (const auto& [k, members] : buckets) {
      int64_t longest = 0;
      for (int64_t id : members) longest = std::max(longest, length_of(samples, id));
      const size_t bs = static_cast<size_t>(std::max<int64_t>(1, st.capacity / longest));
      for (size_t i = 0; i < members.size(); i += bs) {
        MicroBatch mb{{}, 0, st.recompute_layers};
        for (size_t j = i; j < std::min(members.size(), i + bs); ++j) {
          mb.sample_ids.push_back(members[j]);
          mb.num_tokens += length_of(samples, members[j]);
        }
        mbs.push_back(std::move(mb));
      }
    }
    uint64_t state = sample_seed(options.seed, static_cast<uint64_t>(options.epoch),
                                 static_cast<uint64_t>(out.steps.size()));
    for (size_t i = mbs.size(); i > 1; --i) {
      state = sample_seed(state, i, 1);
      std::swap(mbs[i - 1], mbs[state % i]);
    }
    std::vector<GroupPlan> groups;
    for (int64_t g = 0; g < n_groups; ++g) groups.push_back(GroupPlan{g * st.sp_size, st.sp_size, {}});
    for (size_t i = 0; i < mbs.size(); ++i) {
      groups[i % static_cast<size_t>(n_groups)].micro_batches.push_back(std::move(mbs[i]));
    }
    out.steps.push_back(make_step(options, static_cast<int64_t>(out.steps.size()), std::move(groups)));
  }
  return out;
}

}  // namespace dcp
