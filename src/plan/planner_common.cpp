#include "plan/planner_common.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <utility>

#include "dcp/data.h"

namespace dcp {
namespace planner_detail {

void check_world(int64_t world_size) {
  if (world_size < 1) throw std::invalid_argument(fmt::format("planner: world_size {} must be positive", world_size));
}

StaticSetting static_setting(const std::vector<Sample>& samples, int64_t world_size, const CostModel& cost,
                             const MemoryModel& memory, int64_t requested_sp) {
  std::vector<int64_t> sizes;
  for (int64_t s : sp_sizes_allowed(world_size, cost.shape())) {
    if (world_size % s == 0 && (requested_sp == 0 || s == requested_sp)) sizes.push_back(s);
  }
  if (sizes.empty()) {
    throw std::invalid_argument(fmt::format("planner: static_sp_size {} must divide world_size {} and the {} heads",
                                            requested_sp, world_size, cost.shape().heads));
  }
  StaticSetting st;
  st.skipped.assign(samples.size(), 0);
  int64_t longest = 0;
  for (const auto& s : samples) {
    if (!memory.min_recompute_layers(s.length, sizes.back())) {
      st.skipped[static_cast<size_t>(s.id)] = 1;
    } else {
      longest = std::max(longest, s.length);
    }
  }
  if (longest == 0) return st;
  for (int64_t s : sizes) {
    if (auto r = memory.min_recompute_layers(longest, s)) {
      st.sp_size = s;
      st.recompute_layers = *r;
      st.capacity = memory.max_tokens(s, *r);
      break;
    }
  }
  return st;
}

std::vector<int64_t> skipped_ids(const std::vector<char>& skipped) {
  std::vector<int64_t> out;
  for (size_t i = 0; i < skipped.size(); ++i) {
    if (skipped[i]) out.push_back(static_cast<int64_t>(i));
  }
  return out;
}

std::vector<int64_t> epoch_ids(const std::vector<std::vector<int64_t>>& steps) {
  std::vector<int64_t> out;
  for (const auto& s : steps) out.insert(out.end(), s.begin(), s.end());
  return out;
}

std::vector<int64_t> kept(const std::vector<int64_t>& ids, const std::vector<char>& skipped) {
  std::vector<int64_t> out;
  for (int64_t id : ids) {
    if (!skipped[static_cast<size_t>(id)]) out.push_back(id);
  }
  return out;
}

GroupPlan group_of_layout(int64_t first_rank, const SpLayout& layout, std::vector<MicroBatch> micro_batches) {
  GroupPlan g;
  g.first_rank = first_rank;
  g.sp_size = layout.sp_size;
  g.micro_batches = std::move(micro_batches);
  if (layout.ulysses_size == 1 && layout.sp_size > 1) {
    g.sp_mode = SpMode::kRing;
  } else if (layout.ulysses_size < layout.sp_size) {
    g.sp_mode = SpMode::kUlyssesRing;
    g.ulysses_size = layout.ulysses_size;
  }
  return g;
}

StepPlan make_step(const PlannerOptions& opt, int64_t index, std::vector<GroupPlan> groups) {
  StepPlan p;
  p.epoch = opt.epoch;
  p.index = index;
  std::sort(groups.begin(), groups.end(), [](const GroupPlan& a, const GroupPlan& b) {
    return a.round < b.round || (a.round == b.round && a.first_rank < b.first_rank);
  });
  for (const auto& g : groups) {
    for (const auto& mb : g.micro_batches) p.global_num_tokens += mb.num_tokens;
  }
  p.groups = std::move(groups);
  return p;
}

int64_t length_bucket(int64_t length) {
  if (length < 1) throw std::invalid_argument(fmt::format("planner: length {} must be positive", length));
  // The 1e-9 keeps exact powers 2^(k/4) in bucket k despite rounding in log2.
  return static_cast<int64_t>(std::ceil(4.0 * std::log2(static_cast<double>(length)) - 1e-9));
}

std::vector<int64_t> power_of_two_sizes(int64_t world_size, const ModelShape& shape) {
  std::vector<int64_t> out;
  for (int64_t s : sp_sizes_allowed(world_size, shape)) {
    if ((s & (s - 1)) == 0) out.push_back(s);
  }
  return out;
}

std::vector<int64_t> leftover_groups(int64_t world_size, int64_t used, const std::vector<int64_t>& sizes) {
  std::vector<int64_t> out;
  int64_t left = world_size - used;
  for (size_t k = sizes.size(); k-- > 0 && left > 0;) {
    while (sizes[k] <= left) {
      out.push_back(sizes[k]);
      left -= sizes[k];
    }
  }
  return out;
}

StepRng::StepRng(uint64_t seed, int64_t epoch, int64_t step, uint64_t purpose)
    : state_(sample_seed(sample_seed(seed, static_cast<uint64_t>(epoch), static_cast<uint64_t>(step)), purpose, 0)) {}

uint64_t StepRng::next() { return sample_seed(state_, ++counter_, 0); }

double StepRng::uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

size_t StepRng::below(size_t n) {
  if (n == 0) throw std::invalid_argument("StepRng::below: n must be positive");
  // Modulo bias is below n / 2^64, negligible for the sizes planners draw from.
  return static_cast<size_t>(next() % n);
}

void StepRng::shuffle(std::vector<int64_t>& v) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[below(i)]);
}

}  // namespace planner_detail

using namespace planner_detail;

std::vector<std::vector<int64_t>> split_steps(const std::vector<Sample>& samples, const PlannerOptions& options) {
  if (options.samples_per_step <= 0 && options.tokens_per_step <= 0) {
    throw std::invalid_argument("planner: samples_per_step or tokens_per_step must be positive");
  }
  std::vector<int64_t> ids;
  for (size_t i = 0; i < samples.size(); ++i) {
    if (samples[i].id != static_cast<int64_t>(i)) {
      throw std::invalid_argument(fmt::format("planner: sample at index {} has id {}; ids must be 0..n-1", i,
                                              samples[i].id));
    }
    if (samples[i].length < 1) {
      throw std::invalid_argument(fmt::format("planner: sample {} has length {}", i, samples[i].length));
    }
    ids.push_back(static_cast<int64_t>(i));
  }
  const auto order = epoch_order(ids, options.seed, options.epoch);
  std::vector<std::vector<int64_t>> steps;
  std::vector<int64_t> cur;
  int64_t tokens = 0;
  for (int64_t id : order) {
    const int64_t len = length_of(samples, id);
    const bool full = options.samples_per_step > 0 ? static_cast<int64_t>(cur.size()) >= options.samples_per_step
                                                   : tokens + len > options.tokens_per_step;
    if (!cur.empty() && full) {
      steps.push_back(std::move(cur));
      cur.clear();
      tokens = 0;
    }
    cur.push_back(id);
    tokens += len;
  }
  if (!cur.empty()) steps.push_back(std::move(cur));
  return steps;
}

std::vector<int64_t> sp_sizes_allowed(int64_t world_size, const ModelShape& shape) {
  std::vector<int64_t> out;
  const int64_t heads = shape.kv_head_count();
  for (int64_t s = 1; s <= std::min(world_size, heads); ++s) {
    if (heads % s == 0) out.push_back(s);
  }
  return out;
}

std::vector<SpMode> sp_modes_allowed(const ModelShape& shape, const std::vector<SpMode>& modes) {
  if (!modes.empty()) return modes;
  if (shape.attention == AttentionKind::kLinear) return {SpMode::kUlysses};
  return {SpMode::kUlysses, SpMode::kRing, SpMode::kUlyssesRing};
}

std::vector<SpLayout> sp_layouts_allowed(int64_t world_size, const CostModel& cost, const std::vector<SpMode>& modes) {
  check_world(world_size);
  const std::vector<SpMode> allowed = sp_modes_allowed(cost.shape(), modes);
  for (SpMode m : allowed) {
    if (m != SpMode::kUlysses && !cost.supports(SpLayout{2, 1})) {
      throw std::invalid_argument(fmt::format("planner: sp mode {} needs softmax attention, not {}", sp_mode_name(m),
                                              attention_kind_name(cost.shape().attention)));
    }
  }
  auto has = [&](SpMode m) { return std::find(allowed.begin(), allowed.end(), m) != allowed.end(); };
  const int64_t heads = cost.shape().kv_head_count(), node = cost.device().gpus_per_node;
  std::vector<SpLayout> out{SpLayout{1, 1}};
  for (int64_t s = 2; s <= world_size; ++s) {
    if (has(SpMode::kUlysses) && cost.supports(SpLayout{s, s})) out.push_back(SpLayout{s, s});
    if (has(SpMode::kRing)) out.push_back(SpLayout{s, 1});
    if (!has(SpMode::kUlyssesRing)) continue;
    const int64_t largest = ulysses_ring_size(s, 0, heads);
    if (largest == 0) continue;
    out.push_back(SpLayout{s, largest});
    for (int64_t u = largest > node ? node : 1; u > 1; --u) {  // the largest that stays inside a node
      if (s % u == 0 && heads % u == 0) {
        out.push_back(SpLayout{s, u});
        break;
      }
    }
  }
  return out;
}

}  // namespace dcp
