// `dcp-inter` and `dcp-inter-pac`: the reference's DCP-inter planner (dcp-reference.md section 3.5), without
// and with per-bucket recompute (PAC, section 4), on the common steps.
#include <algorithm>
#include <map>
#include <utility>

#include "dcp/planners.h"
#include "plan/bucket_profile.h"
#include "plan/gas_solver.h"
#include "plan/planner_common.h"
#include "plan/step_pool.h"

namespace dcp {

using namespace planner_detail;

namespace {

class InterStep {
 public:
  InterStep(const std::vector<Sample>& samples, const ProfileTable& profile, StepPool& pool, StepRng& rng,
            int64_t world_size, const CostModel& cost)
      : samples_(samples), profile_(profile), pool_(pool), rng_(rng), world_(world_size), cost_(cost) {}

  // native: one iteration of the reference (its first wave only), from a pool that spans the epoch.
  std::vector<GroupPlan> plan(bool native) {
    std::vector<RefGroup> groups = first_micro_batches(native);
    load_.assign(groups.size(), 0.0);
    std::vector<size_t> serving;
    for (size_t g = 0; g < groups.size(); ++g) {
      if (groups[g].key < 0) continue;
      serving.push_back(g);
      load_[g] = setting(groups[g].key, groups[g].sp_size).seconds(size_of(groups[g].micro_batches.front()));
    }
    // Finalize (reference 3.5 step 3): the gas solver balances the groups on their first micro-batches, and
    // each takes its further ones from its bucket.
    accumulate(groups, serving, true);
    if (native) return place_groups(std::move(groups));
    // The step's samples need more waves: keep the layout; a group whose bucket ran out serves a bucket of
    // the largest class it holds. Waves of the reference are separate iterations; here they add up in one
    // step, so a wave serves the groups below the slowest one (all when none of those can serve), least
    // loaded first, with the gas solver balancing their micro-batches. The first group has the step's
    // largest class, so every wave places a sample.
    while (!pool_.empty()) {
      std::vector<size_t> order(groups.size());
      for (size_t g = 0; g < order.size(); ++g) order[g] = g;
      std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return load_[a] < load_[b]; });
      const double slowest = load_[order.back()];
      std::vector<size_t> below, all;
      for (size_t g : order) {
        RefGroup& grp = groups[g];
        if (grp.key < 0 || pool_.remaining(grp.key) == 0) {
          auto key = pool_.draw_largest(grp.sp_size, rng_);
          grp.key = key ? *key : -1;
        }
        if (grp.key < 0) continue;
        all.push_back(g);
        if (load_[g] < slowest) below.push_back(g);
      }
      accumulate(groups, below.empty() ? all : below, false);
    }
    return place_groups(std::move(groups));
  }

 private:
  // The bucket's profiled (bs, recompute) on a group of sp ranks, which is at least the profiled sp_size.
  BucketSetting setting(int64_t key, int64_t sp) const { return profile_.of(key).chosen_on(sp, cost_); }

  // The next micro-batch of bucket `key` for a group of sp ranks: min(bs, what remains) samples.
  MicroBatch next_micro_batch(int64_t key, int64_t sp) {
    const BucketSetting st = setting(key, sp);
    return make_micro_batch(samples_, pool_.take(key, st.bs), st.recompute_layers);
  }

  // Reference 3.5 step 1 on the step's pool: groups of the drawn buckets' sp sizes until no drawn class fits
  // the ranks left, each with its first micro-batch; largest groups first. On a step the first group takes the
  // step's largest class so that a group can hold every bucket of the step in later waves; the reference
  // (native) leaves buckets to later iterations.
  std::vector<RefGroup> first_micro_batches(bool native) {
    std::vector<RefGroup> groups;
    int64_t left = world_;
    std::optional<int64_t> key = native ? pool_.draw(world_, rng_) : pool_.draw_largest(world_, rng_);
    while (key) {
      const int64_t sp = profile_.of(*key).chosen.sp_size;
      groups.push_back(RefGroup{sp, *key, {next_micro_batch(*key, sp)}});
      left -= sp;
      key = pool_.draw(left, rng_);
    }
    // Ranks the fill could not use become groups too (the reference discards such an iteration); they serve
    // buckets from the next wave on.
    for (int64_t s : leftover_groups(world_, world_ - left, profile_.sizes)) groups.push_back(RefGroup{s, -1, {}});
    std::stable_sort(groups.begin(), groups.end(),
                     [](const RefGroup& a, const RefGroup& b) { return a.sp_size > b.sp_size; });
    return groups;
  }

  static int64_t size_of(const MicroBatch& mb) { return static_cast<int64_t>(mb.sample_ids.size()); }

  // One wave of the gas solver over the serving groups: t_i = the predicted time of the group's micro-batch
  // of this wave (its actual sample count; the reference uses the full-bs time even for a bucket's tail);
  // each group's gas is capped by the micro-batches its bucket can still give it (shared evenly by the
  // serving groups of that bucket, rounded up); each group, in the given order, then runs g_i micro-batches
  // of its bucket in this wave (in the first wave the first one is already there) while the bucket lasts.
  void accumulate(std::vector<RefGroup>& groups, const std::vector<size_t>& serving, bool first_wave) {
    std::map<int64_t, int64_t> sharing;
    for (size_t g : serving) ++sharing[groups[g].key];
    std::vector<double> t;
    std::vector<int64_t> caps;
    for (size_t g : serving) {
      const int64_t key = groups[g].key;
      const BucketSetting st = setting(key, groups[g].sp_size);
      t.push_back(st.seconds(first_wave ? size_of(groups[g].micro_batches.front())
                                         : std::min(st.bs, pool_.remaining(key))));
      const int64_t batches = (pool_.remaining(key) + st.bs - 1) / st.bs;
      const int64_t share = (batches + sharing[key] - 1) / sharing[key];
      caps.push_back(std::max<int64_t>(1, share + (first_wave ? 1 : 0)));
    }
    const auto gas = solve_grad_accum_steps(t, kMaxGradAccumSteps, kMinGradAccumSteps, caps);
    for (size_t j = 0; j < serving.size(); ++j) {
      RefGroup& g = groups[serving[j]];
      for (int64_t m = first_wave ? 1 : 0; m < gas[j] && pool_.remaining(g.key) > 0; ++m) {
        g.micro_batches.push_back(next_micro_batch(g.key, g.sp_size));
        load_[serving[j]] += setting(g.key, g.sp_size).seconds(size_of(g.micro_batches.back()));
      }
    }
  }

  const std::vector<Sample>& samples_;
  const ProfileTable& profile_;
  StepPool& pool_;
  StepRng& rng_;
  int64_t world_;
  const CostModel& cost_;
  std::vector<double> load_;  // predicted seconds of each group so far
};

PlanSet plan_inter(const std::vector<Sample>& samples, int64_t world_size, const CostModel& cost,
                   const MemoryModel& memory, const PlannerOptions& options, bool pac) {
  check_world(world_size);
  const auto steps = split_steps(samples, options);
  const ProfileTable profile = profile_buckets(samples, world_size, cost, memory, pac);
  PlanSet out;
  out.skipped_ids = skipped_ids(profile.skipped);
  if (options.native_iterations) {
    StepRng rng(options.seed, options.epoch, 0, pac ? 3 : 2);
    StepPool pool(kept(epoch_ids(steps), profile.skipped), samples, profile, rng, true);
    while (!pool.empty()) {
      InterStep it(samples, profile, pool, rng, world_size, cost);
      out.steps.push_back(make_step(options, static_cast<int64_t>(out.steps.size()), it.plan(true)));
    }
    return out;
  }
  for (size_t s = 0; s < steps.size(); ++s) {
    const auto ids = kept(steps[s], profile.skipped);
    if (ids.empty()) continue;
    StepRng rng(options.seed, options.epoch, static_cast<int64_t>(s), pac ? 3 : 2);
    StepPool pool(ids, samples, profile, rng);
    InterStep step(samples, profile, pool, rng, world_size, cost);
    out.steps.push_back(make_step(options, static_cast<int64_t>(out.steps.size()), step.plan(false)));
  }
  return out;
}

}  // namespace

PlanSet plan_dcp_inter(const std::vector<Sample>& samples, int64_t world_size, const CostModel& cost,
                       const MemoryModel& memory, const PlannerOptions& options) {
  return plan_inter(samples, world_size, cost, memory, options, false);
}

PlanSet plan_dcp_inter_pac(const std::vector<Sample>& samples, int64_t world_size, const CostModel& cost,
                           const MemoryModel& memory, const PlannerOptions& options) {
  return plan_inter(samples, world_size, cost, memory, options, true);
}

}  // namespace dcp
