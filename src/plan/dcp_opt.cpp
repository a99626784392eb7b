// `dcp-opt`: per-step groups, SP sizes, assignment and recompute aiming at the makespan lower bound.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "dcp/planners.h"
#include "plan/planner_common.h"

namespace dcp {

using namespace planner_detail;

namespace {

// One step of dcp-opt: the samples' times at every power-of-two size and the search over group layouts.
class OptStep {
 public:
  OptStep(const std::vector<Sample>& samples, std::vector<int64_t> ids, const std::vector<int64_t>& sizes,
          int64_t world_size, const CostModel& cost, const MemoryModel& memory)
      : samples_(samples), ids_(std::move(ids)), sizes_(sizes), world_(world_size), cost_(cost), memory_(memory) {
    const size_t K = sizes_.size();
    t_.assign(ids_.size(), std::vector<double>(K, kInf));
    std::vector<double> cap0(K);
    for (size_t k = 0; k < K; ++k) cap0[k] = static_cast<double>(memory_.max_tokens(sizes_[k], 0));
    for (size_t i = 0; i < ids_.size(); ++i) {
      const int64_t len = length_of(samples_, ids_[i]);
      for (size_t k = 0; k < K; ++k) {
        auto r = memory_.min_recompute_layers(len, sizes_[k]);
        if (!r) continue;
        const double share = cap0[k] > 0 ? std::min(1.0, static_cast<double>(len) / cap0[k]) : 1.0;
        t_[i][k] = cost_.work_seconds(len, sizes_[k], *r) + cost_.fixed_seconds(sizes_[k], *r) * share;
      }
    }
    // Per size: sample indices by time there, descending (stable), so fill orders samples without sorting.
    by_time_.assign(K, {});
    for (size_t k = 0; k < K; ++k) {
      auto& o = by_time_[k];
      o.resize(ids_.size());
      for (size_t i = 0; i < o.size(); ++i) o[i] = i;
      std::stable_sort(o.begin(), o.end(), [&](size_t a, size_t b) { return t_[a][k] > t_[b][k]; });
    }
  }

  std::vector<GroupPlan> plan() {
    double lo = 0, sum_gpu_s = 0;
    for (const auto& ti : t_) {
      double fastest = kInf, cheapest = kInf;
      for (size_t k = 0; k < sizes_.size(); ++k) {
        fastest = std::min(fastest, ti[k]);
        cheapest = std::min(cheapest, static_cast<double>(sizes_[k]) * ti[k]);
      }
      lo = std::max(lo, fastest);
      sum_gpu_s += cheapest;
    }
    lo = std::max(lo, sum_gpu_s / static_cast<double>(world_));
    // For every smallest allowed size (a floor that trades GPU-seconds for fewer, larger groups), the
    // smallest target the fill meets, then a few looser targets for the best floor.
    Layout best;
    size_t best_floor = 0;
    double best_target = 0;
    for (size_t floor = 0; floor < sizes_.size(); ++floor) {
      auto [target, layout] = smallest_target(lo, floor);
      Layout cand = finish(std::move(layout));
      if (best.groups.empty() || cand.makespan() < best.makespan()) {
        best = std::move(cand), best_floor = floor, best_target = target;
      }
    }
    for (double f : {1.02, 1.05, 1.1, 1.2, 1.35, 1.5}) {
      if (auto l = fill(best_target * f, best_floor)) {
        Layout cand = finish(std::move(*l));
        if (cand.makespan() < best.makespan()) best = std::move(cand);
      }
    }
    return pack(best);
  }

 private:
  struct Layout {
    std::vector<size_t> groups;                // size index of each group
    std::vector<std::vector<size_t>> members;  // sample indices of each group
    std::vector<double> loads;                 // predicted seconds of each group
    double makespan() const { return loads.empty() ? kInf : *std::max_element(loads.begin(), loads.end()); }
  };

  // Bisection for the smallest target (from `lo` up) that fill meets with this floor. The doubling ends: once
  // T exceeds the sum of all times, the first group opened (the largest preferred size, which holds every
  // sample since memory falls with sp) takes every sample.
  std::pair<double, Layout> smallest_target(double lo, size_t floor) const {
    std::optional<Layout> found;
    double hi = lo;
    while (!(found = fill(hi, floor))) hi *= 2;
    for (int i = 0; i < 30 && hi > lo * (1 + 1e-3); ++i) {
      const double mid = 0.5 * (lo + hi);
      if (auto l = fill(mid, floor)) {
        hi = mid;
        found = std::move(l);
      } else {
        lo = mid;
      }
    }
    return {hi, std::move(*found)};
  }

  // The size a sample takes under target T: among sizes from index `floor` up, least GPU-seconds s * t(s)
  // among those with t(s) <= T, else the fastest.
  size_t preferred_size(size_t i, double T, size_t floor) const {
    const auto& ti = t_[i];
    size_t best = sizes_.size(), fastest = floor;
    for (size_t k = floor; k < sizes_.size(); ++k) {
      if (ti[k] < ti[fastest]) fastest = k;
      if (ti[k] > T) continue;
      const double gpu_s = static_cast<double>(sizes_[k]) * ti[k];
      if (best == sizes_.size() || gpu_s < static_cast<double>(sizes_[best]) * ti[best]) best = k;
    }
    return best == sizes_.size() ? fastest : best;
  }

  // Samples by preferred size (from `floor` up), then time, both descending, each into an open group where it
  // finishes by T (least GPU-seconds, then least slack left), else into a new group of its preferred size
  // while ranks remain. nullopt when a sample finds no place.
  // Open groups of each size are kept in a set ordered by (load, group), so the best fit of a size (the largest
  // load that still finishes by T, lowest group among equal loads) is a lookup, not a scan: O(n K log G).
  std::optional<Layout> fill(double T, size_t floor) const {
    const size_t K = sizes_.size();
    std::vector<size_t> pref(ids_.size());
    for (size_t i = 0; i < ids_.size(); ++i) pref[i] = preferred_size(i, T, floor);
    std::vector<size_t> order;
    order.reserve(ids_.size());
    for (size_t k = K; k-- > floor;) {
      for (size_t i : by_time_[k]) {
        if (pref[i] == k) order.push_back(i);
      }
    }
    using Entry = std::pair<double, size_t>;
    std::vector<std::set<Entry>> open(K);
    Layout l;
    int64_t ranks = 0;
    for (size_t i : order) {
      size_t best = l.groups.size();
      double best_cost = kInf, best_slack = kInf;
      for (size_t k = floor; k < K; ++k) {
        const auto& os = open[k];
        const double t = t_[i][k];
        if (os.empty() || t == kInf) continue;
        const double c = static_cast<double>(sizes_[k]) * t;
        if (c > best_cost) continue;
        auto fits = [&](const Entry& e) { return T - e.first - t >= 0; };
        auto it = os.upper_bound(Entry{T - t, SIZE_MAX});
        while (it != os.end() && fits(*it)) ++it;
        while (it != os.begin() && !fits(*std::prev(it))) --it;
        if (it == os.begin()) continue;
        const double load = std::prev(it)->first;
        const size_t g = os.lower_bound(Entry{load, 0})->second;
        const double slack = T - load - t;
        if (c < best_cost || (c == best_cost && (slack < best_slack || (slack == best_slack && g < best)))) {
          best = g, best_cost = c, best_slack = slack;
        }
      }
      if (best == l.groups.size()) {
        if (ranks + sizes_[pref[i]] > world_) return std::nullopt;
        ranks += sizes_[pref[i]];
        l.groups.push_back(pref[i]);
        l.members.emplace_back();
        l.loads.push_back(0.0);
      } else {
        open[l.groups[best]].erase(Entry{l.loads[best], best});
      }
      l.members[best].push_back(i);
      l.loads[best] += t_[i][l.groups[best]];
      open[l.groups[best]].insert(Entry{l.loads[best], best});
    }
    return l;
  }

  // Ranks left over become groups (largest power of two that fits first), groups are ordered largest first
  // for aligned placement, and local search balances the result.
  Layout finish(Layout l) const {
    int64_t left = world_;
    for (size_t k : l.groups) left -= sizes_[k];
    while (left > 0) {
      size_t k = sizes_.size() - 1;
      while (sizes_[k] > left) --k;
      l.groups.push_back(k);
      l.members.emplace_back();
      l.loads.push_back(0.0);
      left -= sizes_[k];
    }
    std::vector<size_t> idx(l.groups.size());
    for (size_t g = 0; g < idx.size(); ++g) idx[g] = g;
    std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return l.groups[a] > l.groups[b]; });
    Layout sorted;
    for (size_t g : idx) {
      sorted.groups.push_back(l.groups[g]);
      sorted.members.push_back(std::move(l.members[g]));
      sorted.loads.push_back(l.loads[g]);
    }
    improve(sorted);
    return sorted;
  }

  // Local search: move or swap a sample of the makespan group while that lowers the pair's maximum. Loads are
  // kept in ordered sets (all groups, and per size), so the makespan group and each size's least-loaded groups
  // are lookups. A move goes to the least-loaded group of a size (the best target of that size); swaps are
  // tried with the kSwapPartners least-loaded groups of each size. Bounded by a count of rounds, not by time.
  void improve(Layout& l) const {
    constexpr size_t kSwapPartners = 2;
    const size_t G = l.groups.size(), K = sizes_.size();
    using Entry = std::pair<double, size_t>;
    std::set<Entry> all;
    std::vector<std::set<Entry>> by_size(K);
    for (size_t g = 0; g < G; ++g) all.insert({l.loads[g], g}), by_size[l.groups[g]].insert({l.loads[g], g});
    auto set_load = [&](size_t g, double v) {
      all.erase({l.loads[g], g});
      by_size[l.groups[g]].erase({l.loads[g], g});
      l.loads[g] = v;
      all.insert({v, g});
      by_size[l.groups[g]].insert({v, g});
    };
    const size_t max_iters = 4 * ids_.size() + 100;
    std::vector<size_t> partners;
    for (size_t it = 0; it < max_iters && G > 1; ++it) {
      const size_t m = all.lower_bound({std::prev(all.end())->first, 0})->second;  // max load, lowest index
      const double top = l.loads[m];
      const size_t km = l.groups[m];
      const double eps = 1e-12 * std::max(1.0, top);
      double best = top - eps;
      size_t bi = 0, bg = G, bj = SIZE_MAX;  // move member bi of m to bg, swapping with member bj when set
      const auto& mm = l.members[m];
      partners.clear();
      for (size_t k = 0; k < K; ++k) {
        size_t taken = 0;
        for (auto e = by_size[k].begin(); e != by_size[k].end() && taken < kSwapPartners; ++e) {
          if (e->second == m) continue;
          partners.push_back(e->second);
          ++taken;
        }
      }
      for (size_t a = 0; a < mm.size(); ++a) {
        const size_t i = mm[a];
        for (size_t k = 0; k < K; ++k) {
          auto e = by_size[k].begin();
          if (e != by_size[k].end() && e->second == m) ++e;
          if (e == by_size[k].end()) continue;
          const size_t g = e->second;
          const double v = std::max(top - t_[i][km], l.loads[g] + t_[i][k]);
          if (v < best) best = v, bi = a, bg = g, bj = SIZE_MAX;
        }
      }
      if (bg == G) {
        for (size_t a = 0; a < mm.size(); ++a) {
          const size_t i = mm[a];
          for (size_t g : partners) {
            const size_t kg = l.groups[g];
            const double base_m = top - t_[i][km], base_g = l.loads[g] + t_[i][kg];
            for (size_t b = 0; b < l.members[g].size(); ++b) {
              const size_t j = l.members[g][b];
              const double v = std::max(base_m + t_[j][km], base_g - t_[j][kg]);
              if (v < best) best = v, bi = a, bg = g, bj = b;
            }
          }
        }
      }
      if (bg == G) return;
      const size_t i = mm[bi];
      double lm = l.loads[m] - t_[i][km], lg = l.loads[bg] + t_[i][l.groups[bg]];
      if (bj == SIZE_MAX) {
        l.members[m].erase(l.members[m].begin() + static_cast<std::ptrdiff_t>(bi));
        l.members[bg].push_back(i);
      } else {
        const size_t j = l.members[bg][bj];
        lm += t_[j][km];
        lg -= t_[j][l.groups[bg]];
        l.members[m][bi] = j;
        l.members[bg][bj] = i;
      }
      set_load(m, lm);
      set_load(bg, lg);
    }
  }

  // Groups placed largest first (aligned: every offset is a sum of larger powers of two), each packing its
  // samples longest first into micro-batches, merging only when that is not slower than running apart.
  std::vector<GroupPlan> pack(const Layout& l) const {
    std::vector<GroupPlan> out;
    int64_t first = 0;
    for (size_t g = 0; g < l.groups.size(); ++g) {
      const int64_t sp = sizes_[l.groups[g]];
      std::vector<int64_t> ids;
      for (size_t i : l.members[g]) ids.push_back(ids_[i]);
      std::stable_sort(ids.begin(), ids.end(),
                       [&](int64_t a, int64_t b) { return length_of(samples_, a) > length_of(samples_, b); });
      struct Bin {
        MicroBatch mb;
        std::vector<int64_t> lengths;
        double seconds;
      };
      std::vector<Bin> bins;
      for (int64_t id : ids) {
        const int64_t len = length_of(samples_, id);
        const int64_t r_alone = *memory_.min_recompute_layers(len, sp);
        const double alone = cost_.seconds({len}, sp, r_alone);
        bool placed = false;
        for (auto& b : bins) {
          auto r = memory_.min_recompute_layers(b.mb.num_tokens + len, sp);
          if (!r) continue;
          std::vector<int64_t> lengths = b.lengths;
          lengths.push_back(len);
          const double merged = cost_.seconds(lengths, sp, *r);
          if (merged > b.seconds + alone) continue;
          b.mb.sample_ids.push_back(id);
          b.mb.num_tokens += len;
          b.mb.recompute_layers = *r;
          b.lengths = std::move(lengths);
          b.seconds = merged;
          placed = true;
          break;
        }
        if (!placed) bins.push_back(Bin{MicroBatch{{id}, len, r_alone}, {len}, alone});
      }
      GroupPlan gp{first, sp, {}};
      for (auto& b : bins) gp.micro_batches.push_back(std::move(b.mb));
      out.push_back(std::move(gp));
      first += sp;
    }
    return out;
  }

  const std::vector<Sample>& samples_;
  std::vector<int64_t> ids_;
  const std::vector<int64_t>& sizes_;
  int64_t world_;
  const CostModel& cost_;
  const MemoryModel& memory_;
  std::vector<std::vector<double>> t_;  // [sample index][size index] predicted seconds, inf when infeasible
  std::vector<std::vector<size_t>> by_time_;  // [size index] sample indices by t_ there, descending, stable
};

}  // namespace

PlanSet plan_dcp_opt(const std::vector<Sample>& samples, int64_t world_size, const CostModel& cost,
                     const MemoryModel& memory, const PlannerOptions& options) {
  check_world(world_size);
  const auto steps = split_steps(samples, options);
  std::vector<int64_t> sizes;
  for (int64_t s : sp_sizes_allowed(world_size, cost.shape())) {
    if ((s & (s - 1)) == 0) sizes.push_back(s);
  }
  std::vector<char> skipped(samples.size(), 0);
  for (const auto& s : samples) {
    if (!memory.min_recompute_layers(s.length, sizes.back())) skipped[static_cast<size_t>(s.id)] = 1;
  }
  PlanSet out;
  out.skipped_ids = skipped_ids(skipped);
  for (const auto& step : steps) {
    auto ids = kept(step, skipped);
    if (ids.empty()) continue;
    OptStep opt(samples, std::move(ids), sizes, world_size, cost, memory);
    out.steps.push_back(make_step(options, static_cast<int64_t>(out.steps.size()), opt.plan()));
  }
  return out;
}

}  // namespace dcp
