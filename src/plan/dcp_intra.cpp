// `dcp-intra`: the reference's DCP-intra planner (dcp-reference.md section 3.4) on the common steps.
#include <algorithm>
#include <cmath>
#include <utility>

#include "dcp/planners.h"
#include "plan/bucket_profile.h"
#include "plan/planner_common.h"
#include "plan/step_pool.h"

namespace dcp {

using namespace planner_detail;

namespace {

// One micro-batch of one group in one wave: n samples of bucket `key` on sp_size ranks, after `base`
// seconds the group already spent in earlier waves.
struct Plan {
  size_t group = 0;  // index into the layout (waves after the first)
  int64_t key = 0;
  int64_t sp_size = 1;
  std::vector<int64_t> ids;
  double base = 0;
};

class IntraStep {
 public:
  IntraStep(const std::vector<Sample>& samples, const ProfileTable& profile, StepPool& pool, StepRng& rng,
            int64_t world_size)
      : samples_(samples), profile_(profile), pool_(pool), rng_(rng), world_(world_size) {}

  // native: one iteration of the reference (its first wave only), from a pool that spans the epoch.
  std::vector<GroupPlan> plan(bool native) {
    std::vector<RefGroup> groups = first_wave(native);
    if (native) return place_groups(std::move(groups));
    std::vector<double> load(groups.size(), 0.0);
    for (size_t g = 0; g < groups.size(); ++g) {
      for (const auto& mb : groups[g].micro_batches) load[g] += seconds_of(mb, groups[g]);
    }
    // The step's samples need more than one wave: keep the layout; every wave gives each group at most one
    // more micro-batch (its bucket while it lasts, else a bucket of the largest SP class it holds), least
    // loaded groups first. Waves of the reference are separate iterations; here they add up in one step,
    // so retarget and top-up balance the groups' accumulated times, and a group already past the wave's
    // target sits it out. The first group has the step's largest class, so every wave places a sample.
    std::vector<size_t> order(groups.size());
    while (!pool_.empty()) {
      for (size_t g = 0; g < order.size(); ++g) order[g] = g;
      std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return load[a] < load[b]; });
      std::vector<Plan> plans;
      for (size_t g : order) {
        const int64_t sp = groups[g].sp_size;
        std::optional<int64_t> key;
        if (groups[g].key >= 0 && pool_.remaining(groups[g].key) > 0) key = groups[g].key;
        if (!key) key = pool_.draw_largest(sp, rng_);
        if (!key) continue;
        groups[g].key = *key;
        plans.push_back(Plan{g, *key, sp, pool_.take(*key, setting(*key, sp).bs), load[g]});
      }
      retarget(plans, false);
      top_up(plans);
      for (const auto& p : plans) {
        if (p.ids.empty()) continue;
        groups[p.group].micro_batches.push_back(micro_batch(p));
        load[p.group] += seconds(p);
      }
    }
    return place_groups(std::move(groups));
  }

 private:
  const BucketSetting& setting(int64_t key, int64_t sp) const { return profile_.of(key).at(sp); }
  double seconds(const Plan& p) const {
    return setting(p.key, p.sp_size).seconds(static_cast<int64_t>(p.ids.size()));
  }
  double seconds_of(const MicroBatch& mb, const RefGroup& g) const {
    return setting(g.key, g.sp_size).seconds(static_cast<int64_t>(mb.sample_ids.size()));
  }
  // A bucket's tail: fewer samples than fit, and none left. The reference drops tails (drop_last) or leaves
  // them out of the balancing (keep_last); they are kept here but never set the target.
  bool tail(const Plan& p) const {
    return pool_.remaining(p.key) == 0 && static_cast<int64_t>(p.ids.size()) < setting(p.key, p.sp_size).bs;
  }
  MicroBatch micro_batch(const Plan& p) const {
    return make_micro_batch(samples_, p.ids, profile_.recompute_layers);
  }

  // Reference 3.4 steps 1-5 on the step's pool; returns the layout, largest groups first (aligned blocks).
  std::vector<RefGroup> first_wave(bool native) {
    std::vector<Plan> plans;
    int64_t left = world_;
    // Fill. On a step the first group takes the step's largest class so that a group can hold every bucket of
    // the step in later waves; the reference (native) leaves buckets to later iterations.
    std::optional<int64_t> key = native ? pool_.draw(world_, rng_) : pool_.draw_largest(world_, rng_);
    while (key) {
      const BucketSetting& st = profile_.of(*key).chosen;
      plans.push_back(Plan{0, *key, st.sp_size, pool_.take(*key, st.bs), 0.0});
      left -= st.sp_size;
      key = pool_.draw(left, rng_);
    }
    retarget(plans, true);
    // Fit: drop the smallest groups while the sizes exceed the world; their samples go back to the pool.
    std::stable_sort(plans.begin(), plans.end(), [](const Plan& a, const Plan& b) { return a.sp_size > b.sp_size; });
    int64_t used = 0;
    for (const auto& p : plans) used += p.sp_size;
    while (used > world_) {
      pool_.give_back(plans.back().key, plans.back().ids);
      used -= plans.back().sp_size;
      plans.pop_back();
    }
    top_up(plans);
    std::vector<RefGroup> groups;
    for (const auto& p : plans) groups.push_back(RefGroup{p.sp_size, p.key, {micro_batch(p)}});
    // Ranks the fill could not use become groups too (the reference discards such an iteration); they take
    // micro-batches from the next wave on.
    for (int64_t s : leftover_groups(world_, used, profile_.sizes)) groups.push_back(RefGroup{s, -1, {}});
    std::stable_sort(groups.begin(), groups.end(),
                     [](const RefGroup& a, const RefGroup& b) { return a.sp_size > b.sp_size; });
    return groups;
  }

  // Retarget (reference 3.4 step 2): t_min = the least finishing time (base + time) of a plan that is not a
  // tail; every other non-tail plan whose bucket differs from that plan's moves towards t_min, trying its
  // size and (grow) the larger ones, with bs = round((t_min - base - fixed) / per-sample time) within
  // [1, what fits and remains]; the closest time wins, and one within 10% of t_min ends the search. Without
  // grow (later waves), a plan whose group already reaches t_min gives its samples back.
  void retarget(std::vector<Plan>& plans, bool grow) {
    const Plan* fastest = nullptr;
    for (const auto& p : plans) {
      if (!tail(p) && (!fastest || p.base + seconds(p) < fastest->base + seconds(*fastest))) fastest = &p;
    }
    if (!fastest) return;
    const double t_min = fastest->base + seconds(*fastest);
    const int64_t key_min = fastest->key;
    std::vector<char> skip(plans.size());
    for (size_t i = 0; i < plans.size(); ++i) skip[i] = tail(plans[i]) || plans[i].key == key_min;
    for (size_t i = 0; i < plans.size(); ++i) {
      Plan& p = plans[i];
      if (skip[i]) continue;
      const double want = t_min - p.base;
      if (!grow && want <= 0) {
        resize(p, 0);
        continue;
      }
      const auto n = static_cast<int64_t>(p.ids.size());
      const int64_t avail = n + pool_.remaining(p.key);
      double best_err = kInf;
      int64_t best_sp = p.sp_size, best_bs = n;
      for (const auto& st : profile_.of(p.key).by_size) {
        if (st.sp_size < p.sp_size || (!grow && st.sp_size > p.sp_size)) continue;
        const int64_t cap = std::min(st.bs, avail);
        const auto bs = std::clamp<int64_t>(std::llround((want - st.fixed_s) / st.work_s), 1, cap);
        const double err = std::abs(st.seconds(bs) - want);
        if (err < best_err) best_err = err, best_sp = st.sp_size, best_bs = bs;
        if (err <= 0.1 * want) break;
      }
      resize(p, best_bs);
      p.sp_size = best_sp;
    }
  }

  // Top-up (reference 3.4 step 4): T* = the least finishing time a non-tail plan could reach (its bs limited
  // by memory and by what remains); every plan finishing earlier takes samples up to T*.
  void top_up(std::vector<Plan>& plans) {
    double t_star = kInf;
    for (const auto& p : plans) {
      if (p.ids.empty() || tail(p)) continue;
      const BucketSetting& st = setting(p.key, p.sp_size);
      const int64_t most = std::min(st.bs, static_cast<int64_t>(p.ids.size()) + pool_.remaining(p.key));
      t_star = std::min(t_star, p.base + st.seconds(most));
    }
    if (t_star == kInf) return;
    for (auto& p : plans) {
      if (p.ids.empty()) continue;
      const BucketSetting& st = setting(p.key, p.sp_size);
      const double end = p.base + seconds(p);
      if (end >= t_star) continue;
      const auto more = static_cast<int64_t>(std::floor((t_star - end) / st.work_s));
      resize(p, std::min(st.bs, static_cast<int64_t>(p.ids.size()) + more));
    }
  }

  // Takes samples from, or gives them back to, the plan's bucket until it holds n.
  void resize(Plan& p, int64_t n) {
    const auto have = static_cast<int64_t>(p.ids.size());
    if (n < have) {
      pool_.give_back(p.key, std::vector<int64_t>(p.ids.begin() + n, p.ids.end()));
      p.ids.resize(static_cast<size_t>(n));
    } else if (n > have) {
      for (int64_t id : pool_.take(p.key, n - have)) p.ids.push_back(id);
    }
  }

  const std::vector<Sample>& samples_;
  const ProfileTable& profile_;
  StepPool& pool_;
  StepRng& rng_;
  int64_t world_;
};

}  // namespace

PlanSet plan_dcp_intra(const std::vector<Sample>& samples, int64_t world_size, const CostModel& cost,
                       const MemoryModel& memory, const PlannerOptions& options) {
  check_world(world_size);
  const auto steps = split_steps(samples, options);
  const ProfileTable profile = profile_buckets(samples, world_size, cost, memory, false);
  PlanSet out;
  out.skipped_ids = skipped_ids(profile.skipped);
  if (options.native_iterations) {
    StepRng rng(options.seed, options.epoch, 0, 1);
    StepPool pool(kept(epoch_ids(steps), profile.skipped), samples, profile, rng, true);
    while (!pool.empty()) {
      IntraStep it(samples, profile, pool, rng, world_size);
      out.steps.push_back(make_step(options, static_cast<int64_t>(out.steps.size()), it.plan(true)));
    }
    return out;
  }
  for (size_t s = 0; s < steps.size(); ++s) {
    const auto ids = kept(steps[s], profile.skipped);
    if (ids.empty()) continue;
    StepRng rng(options.seed, options.epoch, static_cast<int64_t>(s), 1);
    StepPool pool(ids, samples, profile, rng);
    IntraStep step(samples, profile, pool, rng, world_size);
    out.steps.push_back(make_step(options, static_cast<int64_t>(out.steps.size()), step.plan(false)));
  }
  return out;
}

}  // namespace dcp
