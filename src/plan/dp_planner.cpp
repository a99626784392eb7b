#include <fmt/format.h>

#include <algorithm>
#include <numeric>
#include <stdexcept>

#include "dcp/plan.h"

namespace dcp {

std::vector<int64_t> epoch_order(const std::vector<int64_t>& ids, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> order = ids;
  // A stream of its own, so that the order does not depend on the standard library's shuffle.
  uint64_t state = sample_seed(seed, static_cast<uint64_t>(epoch), ~uint64_t{0});
  for (size_t i = order.size(); i > 1; --i) {
    state = sample_seed(state, i, 0);
    std::swap(order[i - 1], order[state % i]);
  }
  return order;
}

namespace {

// Longest first onto the least-loaded group; ties go to the lower group so that every rank computes the same.
std::vector<std::vector<int64_t>> assign_lpt(const std::vector<Sample>& samples, std::vector<int64_t> ids,
                                             int64_t n_groups) {
  std::stable_sort(ids.begin(), ids.end(), [&](int64_t a, int64_t b) {
    return samples[static_cast<size_t>(a)].length > samples[static_cast<size_t>(b)].length;
  });
  std::vector<std::vector<int64_t>> per_group(static_cast<size_t>(n_groups));
  std::vector<int64_t> load(static_cast<size_t>(n_groups), 0);
  for (int64_t id : ids) {
    size_t r = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    per_group[r].push_back(id);
    load[r] += samples[static_cast<size_t>(id)].length;
  }
  return per_group;
}

}  // namespace

std::vector<MicroBatch> pack_first_fit(const std::vector<Sample>& samples, const std::vector<int64_t>& ids,
                                       int64_t capacity, int64_t recompute_layers) {
  std::vector<MicroBatch> bins;
  for (int64_t id : ids) {
    int64_t len = samples[static_cast<size_t>(id)].length;
    auto it = std::find_if(bins.begin(), bins.end(), [&](const MicroBatch& b) { return b.num_tokens + len <= capacity; });
    if (it == bins.end()) {
      bins.push_back(MicroBatch{{}, 0, recompute_layers});
      it = bins.end() - 1;
    }
    it->sample_ids.push_back(id);
    it->num_tokens += len;
  }
  return bins;
}

std::vector<StepPlan> plan_data_parallel(const std::vector<Sample>& samples, const std::vector<int64_t>& order,
                                         int64_t epoch, const DataParallelOptions& opt) {
  if (opt.world_size < 1 || opt.global_batch_tokens < 1 || opt.micro_batch_tokens < 1 || opt.sp_size < 1) {
    throw std::invalid_argument(fmt::format(
        "static planner: world_size {}, global_batch_tokens {}, micro_batch_tokens {}, sp_size {} must all be positive",
        opt.world_size, opt.global_batch_tokens, opt.micro_batch_tokens, opt.sp_size));
  }
  if (opt.world_size % opt.sp_size != 0) {
    throw std::invalid_argument(
        fmt::format("static planner: sp_size {} does not divide world_size {}", opt.sp_size, opt.world_size));
  }
  const int64_t n_groups = opt.world_size / opt.sp_size, capacity = opt.micro_batch_tokens * opt.sp_size;
  std::vector<StepPlan> plans;
  size_t next = 0;
  while (next < order.size()) {
    std::vector<int64_t> step_ids;
    int64_t tokens = 0;
    while (next < order.size()) {
      const Sample& s = samples.at(static_cast<size_t>(order[next]));
      if (s.length > capacity) {
        throw std::invalid_argument(fmt::format("sample {} ({}) has {} tokens, more than micro_batch_tokens {} x sp_size {}",
                                                s.id, s.source, s.length, opt.micro_batch_tokens, opt.sp_size));
      }
      if (!step_ids.empty() && tokens + s.length > opt.global_batch_tokens) break;
      step_ids.push_back(s.id);
      tokens += s.length;
      ++next;
    }
    StepPlan plan;
    plan.epoch = epoch;
    plan.index = static_cast<int64_t>(plans.size());
    plan.global_num_tokens = tokens;
    auto per_group = assign_lpt(samples, step_ids, n_groups);
    for (int64_t g = 0; g < n_groups; ++g) {
      GroupPlan group{g * opt.sp_size, opt.sp_size,
                      pack_first_fit(samples, per_group[static_cast<size_t>(g)], capacity, opt.recompute_layers)};
      if (opt.sp_size > 1) {
        group.sp_mode = opt.sp_mode;
        group.ulysses_size = opt.sp_mode == SpMode::kUlyssesRing ? opt.ulysses_size : 0;
      }
      plan.groups.push_back(std::move(group));
    }
    plans.push_back(std::move(plan));
  }
  return plans;
}

}  // namespace dcp
