#include "plan/step_pool.h"

#include <algorithm>
#include <utility>

namespace dcp::planner_detail {

StepPool::StepPool(const std::vector<int64_t>& ids, const std::vector<Sample>& samples, const ProfileTable& profile,
                   StepRng& rng, bool by_buckets)
    : profile_(profile), by_buckets_(by_buckets) {
  std::map<int64_t, std::vector<int64_t>> by_key;
  for (int64_t id : ids) by_key[length_bucket(length_of(samples, id))].push_back(id);
  for (auto& [key, v] : by_key) {
    rng.shuffle(v);
    ids_[key] = std::deque<int64_t>(v.begin(), v.end());
    left_ += static_cast<int64_t>(v.size());
  }
}

int64_t StepPool::remaining(int64_t key) const {
  auto it = ids_.find(key);
  return it == ids_.end() ? 0 : static_cast<int64_t>(it->second.size());
}

std::vector<int64_t> StepPool::take(int64_t key, int64_t n) {
  std::vector<int64_t> out;
  auto it = ids_.find(key);
  if (it == ids_.end()) return out;
  auto& q = it->second;
  while (n-- > 0 && !q.empty()) {
    out.push_back(q.front());
    q.pop_front();
  }
  left_ -= static_cast<int64_t>(out.size());
  return out;
}

void StepPool::give_back(int64_t key, const std::vector<int64_t>& ids) {
  auto& q = ids_[key];
  q.insert(q.begin(), ids.begin(), ids.end());
  left_ += static_cast<int64_t>(ids.size());
}

std::map<int64_t, std::vector<int64_t>> StepPool::classes() const {
  std::map<int64_t, std::vector<int64_t>> out;
  for (const auto& [key, q] : ids_) {
    if (!q.empty()) out[profile_.of(key).chosen.sp_size].push_back(key);
  }
  return out;
}

std::optional<int64_t> StepPool::draw(int64_t max_sp, StepRng& rng) const {
  const auto cls = classes();
  // GPU-seconds of the class's remaining samples (see the header for why not the number of buckets).
  auto weight = [&](int64_t sp, const std::vector<int64_t>& keys) {
    if (by_buckets_) return static_cast<double>(keys.size());
    double w = 0;
    for (int64_t k : keys) w += static_cast<double>(remaining(k) * sp) * profile_.of(k).chosen.work_s;
    return w;
  };
  double total = 0;
  for (const auto& [sp, keys] : cls) {
    if (sp <= max_sp) total += weight(sp, keys);
  }
  if (total == 0) return std::nullopt;
  const double u = rng.uniform() * total;
  double cumulative = 0;
  const std::vector<int64_t>* chosen = nullptr;
  for (const auto& [sp, keys] : cls) {
    if (sp > max_sp) break;
    chosen = &keys;
    cumulative += weight(sp, keys);
    if (u < cumulative) break;
  }
  return (*chosen)[rng.below(chosen->size())];
}

std::optional<int64_t> StepPool::draw_largest(int64_t max_sp, StepRng& rng) const {
  const auto cls = classes();
  const std::vector<int64_t>* chosen = nullptr;
  for (const auto& [sp, keys] : cls) {
    if (sp <= max_sp) chosen = &keys;
  }
  if (!chosen) return std::nullopt;
  return (*chosen)[rng.below(chosen->size())];
}

MicroBatch make_micro_batch(const std::vector<Sample>& samples, const std::vector<int64_t>& ids,
                            int64_t recompute_layers) {
  MicroBatch mb;
  mb.sample_ids = ids;
  mb.recompute_layers = recompute_layers;
  for (int64_t id : ids) mb.num_tokens += length_of(samples, id);
  return mb;
}

std::vector<GroupPlan> place_groups(std::vector<RefGroup> groups) {
  std::vector<GroupPlan> out;
  int64_t first = 0;
  for (auto& g : groups) {
    out.push_back(GroupPlan{first, g.sp_size, std::move(g.micro_batches)});
    first += g.sp_size;
  }
  return out;
}

}  // namespace dcp::planner_detail
