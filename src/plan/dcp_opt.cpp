// `dcp-opt`: per-step groups, SP sizes, assignment and recompute aiming at the makespan lower bound.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <set>
#include <utility>

#include "dcp/planners.h"
#include "plan/dcp_opt_detail.h"
#include "plan/planner_common.h"

namespace dcp {

using namespace planner_detail;
using namespace dcp_opt_detail;

namespace {

// Relative width at which the bisections over the fill target (and over the floor bound) stop: the target
// found is within 0.05 % of the smallest one the fill meets. 1e-3 saves a fill per search but lowered
// lower_bound_ratio by up to 7e-4 in bench_planners; 5e-4 keeps it within 4e-4 of the earlier version's.
constexpr double kTargetTolerance = 5e-4;
// First step of the bracket above a floor's lower bound; it doubles on each failure. The smallest target the
// fill meets is usually within 1 % of the bound (floor_bound), so small steps bracket it in a few fills.
constexpr double kFirstStep = 1.0 / 128;
// Looser targets retried at the best floor (multiples of its target): a looser fill leaves more slack that
// local search can use. That pays on coarse steps (few samples per group: the tiny brute-force cases of
// test_planners need 1.35 or 1.5), while on steps of thousands of samples the retries moved lower_bound_ratio
// by less than 2e-4 and cost a fill and a long local search each (most of dcp-opt's time at world 1024).
// So they run only while the best makespan is more than kRetryGap above the lower bound, which bounds what
// they can gain (steps of bench_planners at world 1024 end about 1 % above it, tiny cases up to 50 %).
constexpr double kRetries[] = {1.02, 1.05, 1.1, 1.2, 1.35, 1.5};
constexpr double kRetryGap = 0.05;
// dcp-opt tries dense groups for long samples (fill's `dense`) only while the best makespan is more than this
// above the lower bound: below it the gain is small and the extra search costs about ten fills.
constexpr double kDenseGap = 0.01;

// Ordered (load, key) entries of a set of groups (the key names the group, Entry of dcp_opt_detail.h); node
// handles keep updates free of allocation.
using LoadSet = std::set<Entry>;

// Sets g's entry in `s` (found at `pos`) to load v, reusing its node.
void update(LoadSet& s, LoadSet::iterator& pos, double v) {
  auto node = s.extract(pos);
  node.value().first = v;
  pos = s.insert(std::move(node)).position;
}

// Storage of OptStep's tables kept per thread between steps. The tables are megabytes at world 1024 (4096
// samples x 30 layouts, three of them); freed, malloc hands the pages back to the kernel (glibc trims the top of
// its heap beyond 128 KB and maps large blocks), and the next step faults every page in again: up to 480 faults
// per step at world 1024 (getrusage), ~10 us of system time each in this VM (bench/results/
// cpu1_202612_plan_time.md). A table takes the spare vector of the least capacity that holds it (else the
// largest) and gives it back when its step ends; at most kSpares vectors of each type are kept, so a thread
// keeps at most the storage of its largest steps' tables.
template <class T>
class Spares {
 public:
  // A vector of n entries, on a spare's storage when there is one, their values left from its earlier use
  // (the caller writes every entry before reading it).
  static std::vector<T> take_scratch(size_t n) {
    std::vector<T> v = take_storage(n);
    v.resize(n);
    return v;
  }
  // Keeps v's storage for a later take (dropped when kSpares are kept already).
  static void give(std::vector<T>& v) {
    std::vector<std::vector<T>>& list = spares();
    if (v.capacity() == 0 || list.size() >= kSpares) return;
    list.push_back(std::move(v));
  }

 private:
  static constexpr size_t kSpares = 16;
  static std::vector<std::vector<T>>& spares() {
    thread_local std::vector<std::vector<T>> list;
    return list;
  }
  static std::vector<T> take_storage(size_t n) {
    std::vector<std::vector<T>>& list = spares();
    if (list.empty()) return {};
    size_t best = 0;
    for (size_t s = 1; s < list.size(); ++s) {
      const size_t c = list[s].capacity(), b = list[best].capacity();
      if (b >= n ? (c >= n && c < b) : c > b) best = s;
    }
    std::vector<T> v = std::move(list[best]);
    list.erase(list.begin() + static_cast<std::ptrdiff_t>(best));
    return v;
  }
};

// dcp-opt packs the static layout of a size as a fallback only when its bound is this much below the plan
// found (Planner.DcpOptNotSlowerThanStaticLayoutsInItsOwnModel): on steps of thousands of samples the plan is
// within 1 % of the bound and the fallbacks cost more than half of dcp-opt's time at world 1024.
constexpr double kStaticGap = 0.01;

// A packed plan of one partition of the ranks: its groups, each group's predicted seconds (the sum of its
// micro-batches' CostModel::seconds) and their maximum.
struct Packed {
  std::vector<GroupPlan> groups;
  std::vector<double> group_seconds;
  double makespan = 0;
};

// One step of dcp-opt: the samples' times at every power-of-two size (and the world's) and the search over group
// layouts.
class OptStep {
 public:
  // `layouts`: the candidate group layouts, by SP size ascending (several modes may share a size); the step
  // keeps those of a size that are fastest for one of its samples at least (prune).
  OptStep(const std::vector<Sample>& samples, std::vector<int64_t> ids, const std::vector<SpLayout>& layouts,
          int64_t world_size, const CostModel& cost, const MemoryModel& memory)
      : samples_(samples), ids_(std::move(ids)), layouts_(layouts), world_(world_size), cost_(cost), memory_(memory) {
    for (const SpLayout& l : layouts_) sizes_.push_back(l.sp_size);
    // Samples numbered longest first (ties keep the step's order). A sample's time at a size grows with its
    // length, so this is also their order by time at every size where they fit: fill walks the samples in
    // index order (no per-size sort) and reads the tables below sequentially.
    const size_t n = ids_.size();
    const size_t K = sizes_.size();
    ids_ = longest_first(samples_, ids_);
    // Every entry of the three tables is written below (no fill beforehand: they are megabytes).
    t_ = Spares<double>::take_scratch(n * K);
    recompute_ = Spares<int64_t>::take_scratch(n * K);
    work_ = Spares<double>::take_scratch(n * K);
    // The cost model's layer count is the memory model's (both come from one ModelShape, as in every caller).
    layers_ = cost_.shape().layers;
    const size_t row = static_cast<size_t>(layers_ + 1);
    max_tokens_.resize(K * row);
    fixed_.resize(K * row);
    for (size_t k = 0; k < K; ++k) {
      for (int64_t r = 0; r <= layers_; ++r) {
        max_tokens_[k * row + static_cast<size_t>(r)] = memory_.max_tokens(sizes_[k], r);
        fixed_[k * row + static_cast<size_t>(r)] = cost_.fixed_seconds(layouts_[k], r);
      }
    }
    // A row per sample; a sample as long as the one before copies its row (its recompute is -1 until then, so
    // the work table skips it).
    std::vector<int64_t> lengths(n);
    for (size_t i = 0; i < n; ++i) {
      lengths[i] = length_of(samples_, ids_[i]);
      const bool same = i > 0 && lengths[i] == lengths[i - 1];
      for (size_t k = 0; k < K; ++k) {
        const auto r = same ? std::nullopt : recompute_for(lengths[i], k);
        recompute_[i * K + k] = r ? *r : -1;
      }
    }
    cost_.work_seconds(lengths, layouts_, recompute_.data(), work_.data());
    for (size_t i = 0; i < n; ++i) {
      if (i > 0 && lengths[i] == lengths[i - 1]) {  // same length, same row
        std::copy_n(&t_[(i - 1) * K], K, &t_[i * K]);
        std::copy_n(&recompute_[(i - 1) * K], K, &recompute_[i * K]);
        std::copy_n(&work_[(i - 1) * K], K, &work_[i * K]);
        continue;
      }
      for (size_t k = 0; k < K; ++k) {
        const int64_t r = recompute_[i * K + k];
        if (r < 0) {
          t_[i * K + k] = kInf, work_[i * K + k] = kInf;
          continue;
        }
        const double cap0 = static_cast<double>(max_tokens_[k * row]);
        const double share = cap0 > 0 ? std::min(1.0, static_cast<double>(lengths[i]) / cap0) : 1.0;
        t_[i * K + k] = work_[i * K + k] + fixed(k, r) * share;
      }
    }
    prune();
    least_times();
    order_by_cost();
  }

  // The samples `subset` of `parent` (indices into parent.ids(), ascending, so still longest first) with the
  // parent's tables: a round of rounds search (RoundSearch) costs no cost-model evaluation.
  OptStep(const OptStep& parent, const std::vector<size_t>& subset)
      : samples_(parent.samples_), layouts_(parent.layouts_), sizes_(parent.sizes_), world_(parent.world_),
        cost_(parent.cost_), memory_(parent.memory_), layers_(parent.layers_), max_tokens_(parent.max_tokens_),
        fixed_(parent.fixed_) {
    const size_t n = subset.size(), K = sizes_.size();
    ids_.resize(n);
    t_ = Spares<double>::take_scratch(n * K);  // every row copied below
    recompute_ = Spares<int64_t>::take_scratch(n * K);
    work_ = Spares<double>::take_scratch(n * K);
    for (size_t j = 0; j < n; ++j) {
      const size_t i = subset[j];
      ids_[j] = parent.ids_[i];
      std::copy_n(&parent.t_[i * K], K, &t_[j * K]);
      std::copy_n(&parent.recompute_[i * K], K, &recompute_[j * K]);
      std::copy_n(&parent.work_[i * K], K, &work_[j * K]);
    }
    const std::vector<size_t> kept = prune();
    least_times();
    // Each sample's order by GPU-seconds is the parent's restricted to the layouts kept (the same values, and
    // the order is a total one: ties go to the lower index, which keeps its rank among the kept).
    const size_t K2 = sizes_.size();
    std::vector<size_t> index_of(K, SIZE_MAX);
    for (size_t j = 0; j < K2; ++j) index_of[kept[j]] = j;
    by_cost_ = Spares<size_t>::take_scratch(n * K2);  // K2 entries of each row written below
    for (size_t j = 0; j < n; ++j) {
      const size_t* from = &parent.by_cost_[subset[j] * K];
      size_t* to = &by_cost_[j * K2];
      for (size_t a = 0; a < K; ++a) {
        if (index_of[from[a]] != SIZE_MAX) *to++ = index_of[from[a]];
      }
    }
  }

  OptStep(OptStep&&) = default;
  OptStep(const OptStep&) = delete;
  ~OptStep() {
    for (auto* v : {&t_, &work_, &scratch_t_, &scratch_gpu_}) Spares<double>::give(*v);
    Spares<int64_t>::give(recompute_);
    Spares<size_t>::give(by_cost_);
    Spares<size_t>::give(scratch_end_);
  }

  // The samples, longest first (ties keep the step's order): index i of the accessors below.
  const std::vector<int64_t>& ids() const { return ids_; }
  // Sample i's least GPU-seconds over the sizes it fits, counting its work alone (no micro-batch's fixed
  // cost): a group of s ranks spends at least this on it, however it packs.
  double least_work_gpu_seconds(size_t i) const {
    double best = kInf;
    for (size_t k = 0; k < sizes_.size(); ++k) {
      if (t(i, k) < kInf) best = std::min(best, static_cast<double>(sizes_[k]) * work_[i * sizes_.size() + k]);
    }
    return best;
  }
  // Sample i's least time over the sizes (t: its work plus its share of a micro-batch's fixed cost).
  double least_time(size_t i) const {
    double best = kInf;
    for (size_t k = 0; k < sizes_.size(); ++k) best = std::min(best, t(i, k));
    return best;
  }
  // floor_bound over every size for the samples [from, to) alone: no partition of the ranks runs them in less
  // (in the times t).
  double range_bound(size_t from, size_t to) const { return floor_bound(0, kInf, from, to); }
  // Sample i's size of least GPU-seconds, and its time there.
  int64_t cheapest_size(size_t i) const { return sizes_[by_cost_[i * sizes_.size()]]; }
  double cheapest_time(size_t i) const { return t(i, by_cost_[i * sizes_.size()]); }

  Packed plan() {
    const size_t K = sizes_.size();
    // For every floor (it trades GPU-seconds for fewer, larger groups), the smallest target the fill meets,
    // searched from the floor's lower bound, then looser targets for the best floor. After the first floor,
    // a floor must beat the best makespan by twice the target tolerance: it is skipped when its bound does not,
    // and its search is capped there.
    Layout best;
    size_t best_floor = 0;
    bool best_dense = false;
    double best_target = 0, best_lo = 0, bound = kInf;  // bound: the least floor bound, floor 0's, over all sizes
    for (size_t floor = 0; floor < K; ++floor) {
      if (floor > 0 && sizes_[floor - 1] == sizes_[floor]) continue;  // a floor takes every layout of its size
      const double cap = best.groups.empty() ? kInf : best.makespan() * (1 - 2 * kTargetTolerance);
      const double floor_lo = floor_bound(floor, cap);
      bound = std::min(bound, floor_lo);
      if (floor_lo >= cap) continue;
      auto found = smallest_target(floor_lo, cap, floor, false);
      if (!found) continue;
      Layout cand = finish(std::move(found->second));
      if (best.groups.empty() || cand.makespan() < best.makespan()) {
        best = std::move(cand), best_floor = floor, best_target = found->first, best_lo = floor_lo;
      }
    }
    // Long samples opening their preferred size can run out of ranks (see fill's `dense`): try the best floor
    // with dense groups for them while the makespan is far enough above the bound for that to matter.
    if (best.makespan() > bound * (1 + kDenseGap)) {
      if (auto found = smallest_target(best_lo, best.makespan() * (1 - 2 * kTargetTolerance), best_floor, true)) {
        Layout cand = finish(std::move(found->second));
        if (cand.makespan() < best.makespan()) best = std::move(cand), best_target = found->first, best_dense = true;
      }
    }
    for (double f : kRetries) {
      if (best.makespan() <= bound * (1 + kRetryGap)) break;
      if (auto l = fill(best_target * f, best_floor, best_dense)) {
        Layout cand = finish(std::move(*l));
        if (cand.makespan() < best.makespan()) best = std::move(cand);
      }
    }
    // The fill compares layouts in the times t, which share a micro-batch's fixed cost among its tokens; a
    // packed group pays it per micro-batch. Where that cost is large (CPU profiles: milliseconds per
    // micro-batch and per all-to-all), the layout the fill prefers can pack slower than a static one, so the
    // static layouts of every size are packed too (those whose bound leaves them a chance to be kStaticGap
    // faster) and the fastest packed plan is kept: dcp-opt is never more than that slower than them in its
    // own model.
    Packed chosen = pack(best);
    for (size_t k = 0; k < K; ++k) {
      if (uniform_bound(k) >= chosen.makespan * (1 - kStaticGap)) continue;
      if (auto l = uniform(k)) {
        Packed cand = pack(*l);
        if (cand.makespan < chosen.makespan) chosen = std::move(cand);
      }
    }
    return chosen;
  }

 private:
  struct Layout {
    std::vector<size_t> groups;                // size index of each group
    std::vector<std::vector<size_t>> members;  // sample indices of each group
    std::vector<double> loads;                 // predicted seconds of each group
    // As fill leaves it, members still empty (most fills are only tried): samples in placement order and the
    // group of each; finish builds the members from them.
    std::vector<size_t> order, group_of;
    double makespan() const { return loads.empty() ? kInf : *std::max_element(loads.begin(), loads.end()); }
  };

  // Keeps, of the layouts of one SP size, those that are the fastest for one sample at least (the first on
  // ties): at one size, GPU-seconds order like times, so no sample prefers another one, and fewer layouts keep
  // the search as fast as with Ulysses alone. The tables shrink to the layouts kept, in place (a row's kept
  // columns move to lower offsets only). Returns the indices kept, ascending.
  std::vector<size_t> prune() {
    const size_t n = ids_.size(), K = sizes_.size();
    std::vector<char> keep(K, 0);
    for (size_t a = 0; a < K;) {  // the layouts [a, b) of one size
      size_t b = a;
      while (b < K && sizes_[b] == sizes_[a]) ++b;
      for (size_t i = 0; i < n; ++i) {
        size_t best = a;
        for (size_t k = a + 1; k < b; ++k) {
          if (t(i, k) < t(i, best)) best = k;
        }
        if (t(i, best) < kInf) keep[best] = 1;
      }
      if (std::find(keep.begin() + static_cast<std::ptrdiff_t>(a), keep.begin() + static_cast<std::ptrdiff_t>(b),
                    1) == keep.begin() + static_cast<std::ptrdiff_t>(b)) {
        keep[a] = 1;  // no sample fits this size: one layout stands for it
      }
      a = b;
    }
    std::vector<size_t> kept;
    for (size_t k = 0; k < K; ++k) {
      if (keep[k]) kept.push_back(k);
    }
    const size_t K2 = kept.size();
    if (K2 == K) return kept;
    const size_t row = static_cast<size_t>(layers_ + 1);
    for (size_t i = 0; i < n; ++i) {
      for (size_t j = 0; j < K2; ++j) {
        const size_t from = i * K + kept[j], to = i * K2 + j;  // to <= from, and every later read is above from
        t_[to] = t_[from], work_[to] = work_[from], recompute_[to] = recompute_[from];
      }
    }
    t_.resize(n * K2), work_.resize(n * K2), recompute_.resize(n * K2);
    for (size_t j = 0; j < K2; ++j) {
      const size_t k = kept[j];
      layouts_[j] = layouts_[k], sizes_[j] = sizes_[k];
      std::copy_n(&max_tokens_[k * row], row, &max_tokens_[j * row]);
      std::copy_n(&fixed_[k * row], row, &fixed_[j * row]);
    }
    layouts_.resize(K2), sizes_.resize(K2), max_tokens_.resize(K2 * row), fixed_.resize(K2 * row);
    return kept;
  }

  // least_t_: the least time of a sample at each size (open_to_any).
  void least_times() {
    const size_t n = ids_.size(), K = sizes_.size();
    least_t_.assign(K, kInf);
    for (size_t i = 0; i < n; ++i) {
      for (size_t k = 0; k < K; ++k) least_t_[k] = std::min(least_t_[k], t(i, k));
    }
  }

  // Each sample's sizes by GPU-seconds s * t(s), ascending (ties: smaller size). That order does not depend on
  // the target, so fill finds a sample's preferred size and its cheapest open group without scanning every size.
  // The order is a total one (ties by index), so any sort gives it: each row starts from the row before (the
  // samples are longest first, and neighbours mostly order the sizes alike) and is finished by insertion, about
  // K steps per row where a sort from scratch takes K log K comparisons.
  void order_by_cost() {
    const size_t n = ids_.size(), K = sizes_.size();
    by_cost_ = Spares<size_t>::take_scratch(n * K);
    std::vector<double> cost(K);
    for (size_t i = 0; i < n; ++i) {
      size_t* o = &by_cost_[i * K];
      for (size_t k = 0; k < K; ++k) {
        cost[k] = gpu_seconds(i, k);
        o[k] = i > 0 ? o[k - K] : k;
      }
      auto before = [&](size_t a, size_t b) { return cost[a] < cost[b] || (cost[a] == cost[b] && a < b); };
      for (size_t j = 1; j < K; ++j) {
        const size_t k = o[j];
        size_t at = j;
        for (; at > 0 && before(k, o[at - 1]); --at) o[at] = o[at - 1];
        o[at] = k;
      }
    }
  }

  // CostModel::fixed_seconds(layouts_[k], r), from the table.
  double fixed(size_t k, int64_t r) const { return fixed_[k * static_cast<size_t>(layers_ + 1) + static_cast<size_t>(r)]; }

  // Predicted seconds of sample i at size index k (inf when it does not fit), and its GPU-seconds there.
  double t(size_t i, size_t k) const { return t_[i * sizes_.size() + k]; }
  double gpu_seconds(size_t i, size_t k) const { return static_cast<double>(sizes_[k]) * t(i, k); }

  // MemoryModel::min_recompute_layers(tokens, sizes_[k]) from the table of max_tokens: the first count whose
  // capacity holds the tokens fits (max_tokens checks its answer and bytes grow with tokens); it is the fewest
  // when one layer less does not fit (checked, as the table may round down), else the model decides.
  std::optional<int64_t> recompute_for(int64_t tokens, size_t k) const {
    const int64_t* cap = &max_tokens_[k * static_cast<size_t>(layers_ + 1)];
    if (tokens <= cap[0]) return int64_t{0};
    const int64_t r = std::lower_bound(cap, cap + layers_ + 1, tokens) - cap;
    if (r <= layers_ && memory_.bytes(tokens, sizes_[k], r - 1) > memory_.budget_bytes()) return r;
    return memory_.min_recompute_layers(tokens, sizes_[k]);
  }

  // floor_bound's sums over all the samples for every floor at once (one pass, where each floor's own pass
  // would read every sample again): floor_lo_[f], floor_hi_[f] and floor_cheapest_[f] take, sample by sample
  // in index order as floor_bound does, the max of the least time from size index f up, the max of the time
  // at the cheapest size from f up (the first of by_cost_ at f or above) and the sum of its GPU-seconds.
  void floor_sums() const {
    if (!floor_lo_.empty()) return;
    const size_t n = ids_.size(), K = sizes_.size();
    floor_lo_.assign(K, 0.0), floor_hi_.assign(K, 0.0), floor_cheapest_.assign(K, 0.0);
    for (size_t i = 0; i < n; ++i) {
      double least = kInf;  // least time from size index f up, f descending
      for (size_t f = K; f-- > 0;) {
        least = std::min(least, t(i, f));
        floor_lo_[f] = std::max(floor_lo_[f], least);
      }
      const size_t* o = &by_cost_[i * K];
      for (size_t f = 0, j = 0; f < K; ++f) {
        while (o[j] < f) ++j;  // the first of by_cost_ at f or above (its position only grows with f)
        floor_hi_[f] = std::max(floor_hi_[f], t(i, o[j]));
        floor_cheapest_[f] += gpu_seconds(i, o[j]);
      }
    }
  }

  // A lower bound on the makespan (in the times t) of any layout whose groups have sizes from index `floor` up:
  // the smallest T at which every sample has such a size with t(s) <= T and the samples' least GPU-seconds
  // s * t(s) among those sizes fit in world_size * T. A layout with makespan M runs every sample at a size
  // with t <= M and spends at most world_size * M GPU-seconds, so M is at least this T; so is any target the
  // fill meets (its loads stay within the target once every sample has a size that meets it). T minus that
  // sum / world_size grows with T, so a bisection (to kTargetTolerance, returning the lower end) finds it.
  // Returns a bound >= `stop` at once when the bound reaches `stop` (the floor cannot win then).
  // `from` and `to` restrict it to the samples [from, to) (by default all).
  double floor_bound(size_t floor, double stop, size_t from = 0, size_t to = SIZE_MAX) const {
    const size_t n = std::min(to, ids_.size()), K = sizes_.size(), m = n > from ? n - from : 0;
    const double world = static_cast<double>(world_);
    double lo = 0, hi = 0, cheapest = 0;
    // lo: the largest of the samples' least times; hi: of their times at their cheapest size; cheapest: the sum
    // of their least GPU-seconds (all from the floor up).
    if (from == 0 && n == ids_.size()) {
      floor_sums();
      lo = floor_lo_[floor], hi = floor_hi_[floor], cheapest = floor_cheapest_[floor];
    } else {
      for (size_t i = from; i < n; ++i) {
        size_t fastest = floor, first = K;
        for (size_t k = floor; k < K; ++k) {
          if (t(i, k) < t(i, fastest)) fastest = k;
        }
        for (size_t j = 0; j < K && first == K; ++j) {
          if (by_cost_[i * K + j] >= floor) first = by_cost_[i * K + j];
        }
        lo = std::max(lo, t(i, fastest));
        hi = std::max(hi, t(i, first));
        cheapest += gpu_seconds(i, first);
      }
    }
    hi = std::max({lo, hi, cheapest / world});  // every sample at its cheapest size: the sum is `cheapest`
    // Every term meets sums is at least the term `cheapest` sums for the same sample, in the same order, and
    // rounding is monotone, so meets(T) fails whenever cheapest > world * T: here for lo and stop (lo < stop),
    // so the search below would return stop without reading a sample.
    if (lo < stop && stop < hi && cheapest > world * stop) return stop;
    // A sample's preferred size under T (preferred_size) is the first size in its GPU-seconds order, from the
    // floor up, that meets T: one of the sizes faster than every size before it in that order (its steps,
    // usually one to three). So the scan below notes each sample's steps (times and GPU-seconds), and meets
    // reads them where preferred_size would scan the sizes: the same GPU-seconds summed in the same order, so
    // the same bits. At most K steps per sample; the tables keep their storage (Spares).
    if (scratch_t_.size() < m * K) {
      for (auto* v : {&scratch_t_, &scratch_gpu_}) Spares<double>::give(*v), *v = Spares<double>::take_scratch(m * K);
    }
    if (scratch_end_.size() < m) Spares<size_t>::give(scratch_end_), scratch_end_ = Spares<size_t>::take_scratch(m);
    double* step_t = scratch_t_.data();
    double* step_gpu = scratch_gpu_.data();
    size_t* step_end = scratch_end_.data();  // sample from + i's steps end at step_end[i]
    size_t steps = 0;
    for (size_t i = from; i < n; ++i) {
      const size_t* o = &by_cost_[i * K];
      double step = kInf;
      for (size_t j = 0; j < K; ++j) {
        const size_t k = o[j];
        if (k >= floor && t(i, k) < step) {
          step = t(i, k);
          step_t[steps] = step, step_gpu[steps] = gpu_seconds(i, k), ++steps;
        }
      }
      step_end[i - from] = steps;
    }
    auto meets = [&](double T) {
      double sum = 0;
      size_t r = 0;
      for (size_t i = 0; i < m; ++i) {
        const size_t end = step_end[i];
        double g = 0;
        bool found = false;
        for (; r < end && !found; ++r) {
          if (step_t[r] <= T) g = step_gpu[r], found = true;
        }
        // No size meets T (only below lo, which the search never asks): the fastest, as preferred_size.
        if (!found) g = gpu_seconds(from + i, preferred_size(from + i, T, floor));
        r = end;
        sum += g;
      }
      return sum <= world * T;
    };
    if (lo >= stop || meets(lo)) return lo;
    if (stop < hi) {
      if (!meets(stop)) return stop;  // the floor cannot beat `stop`: skip the search
      hi = stop;
    }
    // Bracket it from below first, as smallest_target does: it is usually within a few per cent of lo.
    for (double step = kFirstStep, base = lo; base * (1 + step) < hi; step *= 2) {
      if (meets(base * (1 + step))) {
        hi = base * (1 + step);
        break;
      }
      lo = base * (1 + step);
    }
    while (hi > lo * (1 + kTargetTolerance)) {
      const double mid = std::sqrt(lo * hi);  // geometric: the bracket may span orders of magnitude
      if (meets(mid)) {
        hi = mid;
      } else {
        lo = mid;
      }
    }
    return lo;
  }

  // The smallest target T in [lo, cap] that fill meets with this floor (within kTargetTolerance), and its
  // layout; nullopt when it fails at cap. The bracket grows geometrically above lo (kFirstStep, doubling), then
  // bisects. With cap = inf the bracket ends: once T exceeds the sum of all times, the first group opened (the
  // largest preferred size, which holds every sample since memory falls with sp) takes every sample.
  std::optional<std::pair<double, Layout>> smallest_target(double lo, double cap, size_t floor, bool dense) const {
    double hi = cap;
    std::optional<Layout> found;
    if (cap < kInf) {
      if (!(found = fill(cap, floor, dense))) return std::nullopt;
    } else {
      const double bound = lo;
      hi = lo;
      if ((found = fill(lo, floor, dense))) return std::make_pair(lo, std::move(*found));
      for (double step = kFirstStep; !found; step *= 2) {
        lo = hi;
        hi = bound * (1 + step);
        found = fill(hi, floor, dense);
      }
    }
    while (hi > lo * (1 + kTargetTolerance)) {
      const double mid = 0.5 * (lo + hi);
      if (auto l = fill(mid, floor, dense)) {
        hi = mid;
        found = std::move(l);
      } else {
        lo = mid;
      }
    }
    return std::make_pair(hi, std::move(*found));
  }

  // The size a sample takes under target T: among sizes from index `floor` up, least GPU-seconds s * t(s)
  // among those with t(s) <= T (the first such in by_cost_), else the fastest.
  size_t preferred_size(size_t i, double T, size_t floor) const {
    const size_t K = sizes_.size();
    const size_t* o = &by_cost_[i * K];
    for (size_t j = 0; j < K; ++j) {
      if (o[j] >= floor && t(i, o[j]) <= T) return o[j];
    }
    size_t fastest = floor;
    for (size_t k = floor + 1; k < K; ++k) {
      if (t(i, k) < t(i, fastest)) fastest = k;
    }
    return fastest;
  }

  // Whether a group of size index k and `load` can still take a sample by T: the shortest (the fastest at every
  // size) fits it. Else no sample does (fill's fit, T - load - t >= 0, is monotone in t, rounding included).
  bool open_to_any(double T, double load, size_t k) const { return T - load - least_t_[k] >= 0; }

  // Samples by preferred size (from `floor` up), then time, both descending, each into an open group where it
  // finishes by T (least GPU-seconds, then least slack left, then lowest group), else into a new group of its
  // preferred size while ranks remain (with `dense`, of dense_size for long samples). nullopt when a sample
  // finds no place.
  // Open groups of each size are kept in order of (load, SIZE_MAX - group) (LoadBlocks), so the best fit of a
  // size (the largest load that still finishes by T, lowest group among equal loads) is one lookup; sizes are
  // tried in the sample's GPU-seconds order and the search stops at the first size dearer than a fit:
  // O(n K log G). A group that not even the step's shortest sample fits any more (open_to_any) leaves its list:
  // no lookup could return it, and at world 1024 nearly every group fills up so (the lists stay short).
  std::optional<Layout> fill(double T, size_t floor, bool dense) const {
    const size_t n = ids_.size(), K = sizes_.size();
    std::vector<size_t> pref(n), start(K + 1, 0);
    for (size_t i = 0; i < n; ++i) {
      pref[i] = preferred_size(i, T, floor);
      ++start[K - 1 - pref[i] + 1];  // larger sizes first
    }
    for (size_t k = 0; k < K; ++k) start[k + 1] += start[k];
    std::vector<size_t> order(n);
    for (size_t i = 0; i < n; ++i) order[start[K - 1 - pref[i]]++] = i;
    // With `dense`: the long samples (over T / 2 at their preferred size) still to place from each position
    // on, in its preferred size; they lead their size's run of `order`, longest first.
    std::vector<size_t> long_left;
    if (dense) {
      long_left.assign(n, 0);
      for (size_t p = n; p-- > 0;) {
        const size_t i = order[p];
        if (2 * t(i, pref[i]) <= T) continue;
        long_left[p] = 1 + (p + 1 < n && pref[order[p + 1]] == pref[i] ? long_left[p + 1] : 0);
      }
    }
    std::vector<LoadBlocks> open(K);
    std::vector<size_t> group_of(n);
    Layout l;
    int64_t ranks = 0;
    for (size_t p = 0; p < n; ++p) {
      const size_t i = order[p];
      size_t best = l.groups.size();
      LoadBlocks::Pos best_at;  // its place in open[its size]
      double best_cost = kInf, best_slack = kInf;
      const size_t* o = &by_cost_[i * K];
      for (size_t j = 0; j < K; ++j) {
        const size_t k = o[j];
        const double tk = t(i, k);
        if (k < floor || tk > T || open[k].empty()) continue;  // no group of size k can take it by T
        const double c = gpu_seconds(i, k);
        if (c > best_cost) break;  // every later size is at least as dear
        // The largest load that still fits (fits holds for a prefix of the order: loads ascending).
        auto fits = [&](const Entry& e) { return T - e.first - tk >= 0; };
        const auto at = open[k].last_where(fits);
        if (!at) continue;  // not even the least-loaded group of this size
        const Entry& e = open[k].at(*at);
        const double load = e.first;
        const size_t g = SIZE_MAX - e.second;  // the last entry of that load: its lowest group
        const double slack = T - load - tk;
        if (c < best_cost || slack < best_slack || (slack == best_slack && g < best)) {
          best = g, best_cost = c, best_slack = slack, best_at = *at;
        }
      }
      if (best == l.groups.size()) {
        const size_t k = dense && long_left[p] > 0 ? dense_size(i, T, floor, long_left[p], world_ - ranks) : pref[i];
        if (ranks + sizes_[k] > world_) return std::nullopt;
        ranks += sizes_[k];
        l.groups.push_back(k);
        l.loads.push_back(t(i, k));
        if (open_to_any(T, t(i, k), k)) open[k].insert(Entry{t(i, k), SIZE_MAX - best});
      } else {
        const size_t k = l.groups[best];
        l.loads[best] += t(i, k);
        if (open_to_any(T, l.loads[best], k)) {
          open[k].update(best_at, l.loads[best]);
        } else {
          open[k].erase(best_at);
        }
      }
      group_of[i] = best;
    }
    l.order = std::move(order);
    l.group_of = std::move(group_of);
    return l;
  }

  // The size of a new group for long sample i (over T / 2 at its preferred size, so a group of that size holds
  // one of it) with `left` long samples of its preferred size still to place (it included) and `ranks` free:
  // the size, among those from `floor` up that fit the ranks and run it by T, that holds the most of them per
  // rank (copies of i by T, at most `left`, over the size); the preferred size on ties. Preferring least
  // GPU-seconds alone opens one group per long sample and may run out of ranks where larger groups holding
  // several fit (world 24: four 432k-token samples as 8 + 8 + 8 + 8 ranks, not 16 (three) + 8 (one)).
  size_t dense_size(size_t i, double T, size_t floor, size_t left, int64_t ranks) const {
    size_t best = preferred_size(i, T, floor);
    double best_rate = sizes_[best] <= ranks ? 1.0 / static_cast<double>(sizes_[best]) : 0.0;
    for (size_t k = floor; k < sizes_.size(); ++k) {
      if (sizes_[k] > ranks || t(i, k) > T) continue;
      const double copies = std::min(std::floor(T / t(i, k)), static_cast<double>(left));
      const double rate = copies / static_cast<double>(sizes_[k]);
      if (rate > best_rate) best = k, best_rate = rate;
    }
    return best;
  }

  // Ranks left over become groups (largest power of two that fits first), groups are ordered largest first
  // for aligned placement, and local search balances the result.
  Layout finish(Layout l) const {
    l.members.resize(l.groups.size());  // in placement order
    for (size_t i : l.order) l.members[l.group_of[i]].push_back(i);
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
    sorted.groups.reserve(idx.size());
    sorted.members.reserve(idx.size());
    sorted.loads.reserve(idx.size());
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
    LoadSet all;
    std::vector<LoadSet> by_size(K);
    std::vector<LoadSet::iterator> in_all(G), in_size(G);
    for (size_t g = 0; g < G; ++g) {
      in_all[g] = all.insert({l.loads[g], g}).first;
      in_size[g] = by_size[l.groups[g]].insert({l.loads[g], g}).first;
    }
    auto set_load = [&](size_t g, double v) {
      l.loads[g] = v;
      update(all, in_all[g], v);
      update(by_size[l.groups[g]], in_size[g], v);
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
          const double v = std::max(top - t(i, km), l.loads[g] + t(i, k));
          if (v < best) best = v, bi = a, bg = g, bj = SIZE_MAX;
        }
      }
      if (bg == G) {
        for (size_t a = 0; a < mm.size(); ++a) {
          const size_t i = mm[a];
          for (size_t g : partners) {
            const size_t kg = l.groups[g];
            const double base_m = top - t(i, km), base_g = l.loads[g] + t(i, kg);
            for (size_t b = 0; b < l.members[g].size(); ++b) {
              const size_t j = l.members[g][b];
              const double v = std::max(base_m + t(j, km), base_g - t(j, kg));
              if (v < best) best = v, bi = a, bg = g, bj = b;
            }
          }
        }
      }
      if (bg == G) return;
      const size_t i = mm[bi];
      double lm = l.loads[m] - t(i, km), lg = l.loads[bg] + t(i, l.groups[bg]);
      if (bj == SIZE_MAX) {
        l.members[m].erase(l.members[m].begin() + static_cast<std::ptrdiff_t>(bi));
        l.members[bg].push_back(i);
      } else {
        const size_t j = l.members[bg][bj];
        lm += t(j, km);
        lg -= t(j, l.groups[bg]);
        l.members[m][bi] = j;
        l.members[bg][bj] = i;
      }
      set_load(m, lm);
      set_load(bg, lg);
    }
  }

  // Groups placed largest first (aligned: every offset is a sum of larger powers of two), each packing its
  // samples longest first into micro-batches (pack_group).
  Packed pack(const Layout& l) const {
    const size_t K = sizes_.size();
    Packed out;
    int64_t first = 0;
    std::vector<size_t> members;
    for (size_t g = 0; g < l.groups.size(); ++g) {
      const size_t k = l.groups[g];
      members = l.members[g];
      // Longest first, ties in placement order (a stable sort; by insertion for the few members of most groups,
      // which std::stable_sort would give a buffer from the heap).
      auto longer = [&](size_t a, size_t b) { return length_of(samples_, ids_[a]) > length_of(samples_, ids_[b]); };
      if (members.size() <= 32) {
        for (size_t j = 1; j < members.size(); ++j) {
          const size_t x = members[j];
          size_t at = j;
          for (; at > 0 && longer(x, members[at - 1]); --at) members[at] = members[at - 1];
          members[at] = x;
        }
      } else {
        std::stable_sort(members.begin(), members.end(), longer);
      }
      // Merging saves a micro-batch's fixed cost but may raise the recompute of every sample in it: greedy
      // merging can pile the group onto one heavily recomputed micro-batch where two lighter ones are faster
      // (a CPU profile's ~10 ms per micro-batch makes that common). So the group is also packed without
      // raising any micro-batch above the recompute its longest sample needs alone, and the faster is kept.
      auto [bins, seconds] = pack_group(members, k, layers_);
      if (!members.empty()) {
        const int64_t r_longest = recompute_[members.front() * K + k];
        const bool raised = std::any_of(bins.begin(), bins.end(),
                                        [&](const MicroBatch& mb) { return mb.recompute_layers > r_longest; });
        if (raised) {
          auto capped = pack_group(members, k, r_longest);
          if (capped.second < seconds) bins = std::move(capped.first), seconds = capped.second;
        }
      }
      out.makespan = std::max(out.makespan, seconds);
      out.group_seconds.push_back(seconds);
      out.groups.push_back(group_of_layout(first, layouts_[k], std::move(bins)));
      first += sizes_[k];
    }
    return out;
  }

  // The least seconds any packing of a static layout at size index k can take: its groups share the samples'
  // work_seconds alone (merging never lowers a sample's recompute below what it needs alone), each runs at
  // least one micro-batch's fixed seconds, and the longest sample runs whole on one group; inf when a sample
  // does not fit there. O(samples), so most sizes are ruled out before their layout is built.
  double uniform_bound(size_t k) const {
    const size_t K = sizes_.size(), n = ids_.size();
    if (n == 0) return 0;
    double work = 0;
    int64_t r_min = layers_;
    for (size_t i = 0; i < n; ++i) {
      if (!(t(i, k) < kInf)) return kInf;
      work += work_[i * K + k], r_min = std::min(r_min, recompute_[i * K + k]);
    }
    const double groups = static_cast<double>(world_ / sizes_[k]);
    const double longest = work_[k] + fixed(k, recompute_[k]);  // ids_ are longest first
    return std::max(longest, work / groups + fixed(k, r_min));
  }

  // Every sample at size index k on world / size groups, longest first onto the least loaded (LPT in t): the
  // layout of a static planner at that size. nullopt when a sample does not fit there or the size does not
  // divide the world.
  std::optional<Layout> uniform(size_t k) const {
    const int64_t size = sizes_[k];
    if (world_ % size != 0) return std::nullopt;
    const size_t n = ids_.size(), G = static_cast<size_t>(world_ / size);
    Layout l;
    l.groups.assign(G, k);
    l.members.resize(G);
    l.loads.assign(G, 0.0);
    LoadSet open;
    for (size_t g = 0; g < G; ++g) open.insert({0.0, g});
    for (size_t i = 0; i < n; ++i) {  // ids_ are longest first
      if (!(t(i, k) < kInf)) return std::nullopt;
      auto least = open.begin();
      const size_t g = least->second;
      open.erase(least);
      l.members[g].push_back(i);
      l.loads[g] += t(i, k);
      open.insert({l.loads[g], g});
    }
    return l;
  }

  // The micro-batches of one group at size index k from its members (longest first) and their summed seconds:
  // each sample goes into the micro-batch where merging saves the most (best fit, not first fit: a merge that
  // raises a long micro-batch's recompute can cost more than joining a shorter one), if any saves, with at
  // most r_cap recomputed layers there; else into a new micro-batch. A micro-batch's seconds are summed sample
  // by sample in the order CostModel::seconds sums them, so adding a sample costs one work_seconds (often from
  // the table), not a re-evaluation of the micro-batch.
  std::pair<std::vector<MicroBatch>, double> pack_group(const std::vector<size_t>& members, size_t k,
                                                        int64_t r_cap) const {
    const size_t K = sizes_.size();
    const SpLayout& sp = layouts_[k];
    struct Bin {
      MicroBatch mb;
      std::vector<int64_t> lengths;
      double seconds;
      // Seconds of the same samples at another recompute count, kept until the bin changes: the samples
      // that follow mostly try a bin at the same count.
      int64_t other_r = -1;
      double other_seconds = 0;
    };
    std::vector<Bin> bins;
    for (size_t i : members) {
      const int64_t id = ids_[i], len = length_of(samples_, id);
      const int64_t r_alone = recompute_[i * K + k];
      const double alone = fixed(k, r_alone) + work_[i * K + k];
      Bin* into = nullptr;
      double into_seconds = 0, into_gain = -1;
      int64_t into_r = 0;
      for (auto& b : bins) {
        auto r = recompute_for(b.mb.num_tokens + len, k);
        if (!r || *r > r_cap) continue;
        double base = b.seconds;
        if (*r != b.mb.recompute_layers) {
          if (b.other_r != *r) b.other_r = *r, b.other_seconds = cost_.seconds(b.lengths, sp, *r);
          base = b.other_seconds;
        }
        const double merged = base + (*r == r_alone ? work_[i * K + k] : cost_.work_seconds(len, sp, *r));
        const double gain = b.seconds + alone - merged;
        if (gain < 0 || gain <= into_gain) continue;
        into = &b, into_seconds = merged, into_gain = gain, into_r = *r;
        // Recompute never falls when tokens are added, so no bin saves more than the whole fixed cost, which
        // a bin at the sample's own recompute count saves: take the first such (first fit, and no full scan).
        if (*r == r_alone && *r == b.mb.recompute_layers) break;
      }
      if (into == nullptr) {
        bins.push_back(Bin{MicroBatch{{id}, len, r_alone}, {len}, alone, -1, 0.0});
        continue;
      }
      into->lengths.push_back(len);
      into->other_r = -1;
      into->mb.sample_ids.push_back(id);
      into->mb.num_tokens += len;
      into->mb.recompute_layers = into_r;
      into->seconds = into_seconds;
    }
    std::vector<MicroBatch> out;
    double seconds = 0;
    for (auto& b : bins) seconds += b.seconds, out.push_back(std::move(b.mb));
    return {std::move(out), seconds};
  }

  const std::vector<Sample>& samples_;
  std::vector<int64_t> ids_;
  std::vector<SpLayout> layouts_;  // by size index: the group layout (SP size and mode)
  std::vector<int64_t> sizes_;     // by size index: layouts_[k].sp_size, ascending (equal for modes of a size)
  int64_t world_;
  const CostModel& cost_;
  const MemoryModel& memory_;
  // [sample index * K + size index], K = sizes_.size():
  std::vector<double> t_;            // predicted seconds, inf when infeasible
  std::vector<int64_t> recompute_;   // fewest recompute layers alone, -1 when infeasible
  std::vector<double> work_;         // CostModel::work_seconds at that recompute count
  std::vector<size_t> by_cost_;      // size indices by GPU-seconds, ascending
  std::vector<double> least_t_;      // by size index: the least time of a sample there (inf: none fits)
  int64_t layers_ = 0;
  // floor_bound's per-call tables (kept for their storage) and floor_sums.
  mutable std::vector<double> scratch_t_, scratch_gpu_;
  mutable std::vector<double> floor_lo_, floor_hi_, floor_cheapest_;
  mutable std::vector<size_t> scratch_end_;
  std::vector<int64_t> max_tokens_;  // [size index * (layers_ + 1) + r] MemoryModel::max_tokens(size, r)
  std::vector<double> fixed_;        // [size index * (layers_ + 1) + r] CostModel::fixed_seconds(layout, r)
};

// Rounds (StepPlan rounds): the step's longest samples in one round on the groups they need, the others in
// later rounds at their own best sizes, when the sum of the rounds' makespans (plus the switches) beats the one
// partition. Greedy over a few splits of the samples by length (longest first):
//  - candidates: the samples whose cheapest size (least GPU-seconds) is above 1, and those whose time at their
//    cheapest size exceeds 1, 1/2 or 1/4 of the step's bound (alone they would hold a small group longer than
//    the step should last); each candidate is a prefix of the samples by length;
//  - a candidate is skipped when a lower bound of the two rounds (for each, the larger of its samples' least
//    GPU-seconds over world_size and its slowest sample's least time) cannot beat the best plan so far;
//  - round 0 is the prefix planned by dcp-opt (OptStep); the slack its groups leave (GPU-seconds below its
//    makespan) takes the longest other samples that fit it, and round 0 is planned again with them if that
//    does not lengthen it; the rest is round 1, one partition;
//  - the best candidate is kept when it beats the best plan by kRoundGain, and its round 1 is split again the
//    same way while rounds are allowed (max_rounds: 0 = no limit).
// Every plan compared is packed, in the seconds evaluate_step predicts, so a plan of rounds is never slower
// than the one partition in dcp-opt's own model.
constexpr double kRoundGain = 1e-3;
// Share of round 0's slack the moved samples' least GPU-seconds may fill: packing them into groups whose loads
// differ leaves some of it unusable.
constexpr double kSlackUse = 0.9;

class RoundSearch {
 public:
  RoundSearch(const std::vector<Sample>& samples, const std::vector<SpLayout>& layouts, int64_t world_size,
              const CostModel& cost, const MemoryModel& memory, int64_t max_rounds)
      : samples_(samples), layouts_(layouts), world_(world_size), cost_(cost), memory_(memory),
        max_rounds_(max_rounds <= 0 ? std::numeric_limits<int64_t>::max() : max_rounds),
        switch_s_(cost.device().round_switch_s) {}

  // The step's groups, round by round (GroupPlan::round set).
  std::vector<GroupPlan> plan(std::vector<int64_t> ids) const {
    OptStep whole(samples_, std::move(ids), layouts_, world_, cost_, memory_);
    Packed one = whole.plan();
    std::vector<Packed> rounds;
    if (max_rounds_ > 1) {
      double seconds = one.makespan;
      rounds = split(whole, seconds, max_rounds_);
    }
    if (rounds.empty()) rounds.push_back(std::move(one));
    // Consecutive rounds of the same partition (the same groups: ranks, sizes and modes) run as one round, each
    // group's micro-batches back to back: never slower in the model (max over groups of a_g + b_g is at most
    // max a + max b, and one switch fewer), and at world 1 a step is always one round.
    std::vector<Packed> merged;
    for (auto& r : rounds) {
      if (!merged.empty() && same_partition(merged.back(), r)) {
        for (size_t g = 0; g < r.groups.size(); ++g) {
          auto& to = merged.back().groups[g].micro_batches;
          auto& from = r.groups[g].micro_batches;
          to.insert(to.end(), std::make_move_iterator(from.begin()), std::make_move_iterator(from.end()));
        }
      } else {
        merged.push_back(std::move(r));
      }
    }
    std::vector<GroupPlan> out;
    for (size_t r = 0; r < merged.size(); ++r) {
      for (auto& g : merged[r].groups) {
        g.round = static_cast<int64_t>(r);
        out.push_back(std::move(g));
      }
    }
    return out;
  }

 private:
  // Whether two rounds have the same groups in the same order (first rank, size, mode, Ulysses size).
  static bool same_partition(const Packed& a, const Packed& b) {
    if (a.groups.size() != b.groups.size()) return false;
    for (size_t g = 0; g < a.groups.size(); ++g) {
      const GroupPlan &x = a.groups[g], &y = b.groups[g];
      if (x.first_rank != y.first_rank || x.sp_size != y.sp_size ||
          x.layout().ulysses_size != y.layout().ulysses_size) {
        return false;
      }
    }
    return true;
  }

  // Rounds of `step`'s samples that beat `best_s` (the seconds of its one partition, already planned) by
  // kRoundGain, at most `rounds_left` of them; empty when no split does. On success best_s is their seconds
  // (makespans and switches).
  std::vector<Packed> split(const OptStep& step, double& best_s, int64_t rounds_left) const {
    const std::vector<int64_t>& ids = step.ids();
    const size_t n = ids.size();
    if (n < 2 || rounds_left < 2) return {};
    // Prefix sums of the samples' least work GPU-seconds. A sample's least time grows with its length (at every
    // size, and fewer sizes hold a longer one), so the slowest of [from, to) is its first.
    std::vector<double> gpu(n + 1, 0.0);
    for (size_t i = 0; i < n; ++i) gpu[i + 1] = gpu[i] + step.least_work_gpu_seconds(i);
    const double world = static_cast<double>(world_);
    auto bound = [&](size_t from, size_t to) {  // no round holding samples [from, to) is shorter
      return std::max((gpu[to] - gpu[from]) / world, step.least_time(from));
    };
    std::vector<size_t> candidates;
    auto add = [&](size_t m) {
      if (m > 0 && m < n && std::find(candidates.begin(), candidates.end(), m) == candidates.end()) {
        candidates.push_back(m);
      }
    };
    size_t large = 0;  // the longest samples whose cheapest size is above 1
    while (large < n && step.cheapest_size(large) > 1) ++large;
    add(large);
    const double whole = bound(0, n);
    for (double f : {1.0, 0.5, 0.25}) {
      size_t m = 0;
      while (m < n && step.cheapest_time(m) > f * whole) ++m;
      add(m);
    }
    std::vector<Packed> best;
    std::optional<OptStep> best_rest;
    double best_rest_s = 0;
    for (size_t m : candidates) {
      const double rest_lo = bound(m, n);
      if (bound(0, m) + rest_lo + switch_s_ >= best_s * (1 - kRoundGain)) continue;
      // The long samples' own bound sees what the GPU-seconds alone do not: that they run whole, at sizes
      // where each finishes in time (O(m K) per evaluation, m the few long samples).
      if (step.range_bound(0, m) + rest_lo + switch_s_ >= best_s * (1 - kRoundGain)) continue;
      std::vector<size_t> head(m), tail;
      for (size_t i = 0; i < m; ++i) head[i] = i;
      Packed first = OptStep(step, head).plan();
      if (first.makespan + rest_lo + switch_s_ >= best_s * (1 - kRoundGain)) continue;
      // Round 0's slack takes the longest other samples that fit it (by their least GPU-seconds, each finishing
      // within round 0 alone).
      double slack = 0;
      for (size_t g = 0; g < first.groups.size(); ++g) {
        slack += static_cast<double>(first.groups[g].sp_size) * (first.makespan - first.group_seconds[g]);
      }
      slack *= kSlackUse;
      std::vector<size_t> fuller_head = head, kept_tail;
      for (size_t i = m; i < n; ++i) {
        const double g = step.least_work_gpu_seconds(i);
        if (g <= slack && step.least_time(i) <= first.makespan) {
          fuller_head.push_back(i);
          slack -= g;
        } else {
          kept_tail.push_back(i);
        }
      }
      if (fuller_head.size() > head.size() && !kept_tail.empty()) {
        Packed fuller = OptStep(step, fuller_head).plan();
        if (fuller.makespan <= first.makespan * (1 + kRoundGain)) {
          first = std::move(fuller);
          tail = std::move(kept_tail);
        }
      }
      if (tail.empty()) {
        for (size_t i = m; i < n; ++i) tail.push_back(i);
      }
      OptStep rest(step, tail);
      Packed second = rest.plan();
      const double total = first.makespan + second.makespan + switch_s_;
      if (total < best_s * (1 - kRoundGain)) {
        best_s = total, best_rest_s = second.makespan;
        best.clear();
        best.push_back(std::move(first));
        best.push_back(std::move(second));
        best_rest.emplace(std::move(rest));
      }
    }
    if (best.empty() || rounds_left < 3) return best;
    // The last round split again, while that pays.
    double rest_s = best_rest_s;
    std::vector<Packed> more = split(*best_rest, rest_s, rounds_left - 1);
    if (!more.empty()) {
      best_s = best[0].makespan + switch_s_ + rest_s;
      best.pop_back();
      for (auto& p : more) best.push_back(std::move(p));
    }
    return best;
  }

  const std::vector<Sample>& samples_;
  const std::vector<SpLayout>& layouts_;
  int64_t world_;
  const CostModel& cost_;
  const MemoryModel& memory_;
  int64_t max_rounds_;
  double switch_s_;
};

}  // namespace

PlanSet plan_dcp_opt(const std::vector<Sample>& samples, int64_t world_size, const CostModel& cost,
                     const MemoryModel& memory, const PlannerOptions& options) {
  check_world(world_size);
  const auto steps = split_steps(samples, options);
  std::vector<SpLayout> layouts;
  // Power-of-two sizes (any mix of them tiles the ranks in aligned blocks, largest first), and the whole world
  // when it is not one: a group of every rank stands alone in its layout, so alignment holds, and at world 12
  // or 24 a sample that runs best (or only fits) on more than the largest power of two gets all the ranks.
  for (const SpLayout& l : sp_layouts_allowed(world_size, cost, options.sp_modes)) {
    if ((l.sp_size & (l.sp_size - 1)) == 0 || l.sp_size == world_size) layouts.push_back(l);
  }
  std::vector<char> skipped(samples.size(), 0);
  // A sample fits the largest size when min_recompute_layers finds a count: when it is at most max_tokens there
  // with every layer recomputed (that many fit, and bytes grow with tokens), else as the model decides.
  const int64_t largest = layouts.back().sp_size, fits_all = memory.max_tokens(largest, memory.shape().layers);
  for (const auto& s : samples) {
    if (s.length <= fits_all && s.length >= 1) continue;
    if (!memory.min_recompute_layers(s.length, largest)) skipped[static_cast<size_t>(s.id)] = 1;
  }
  PlanSet out;
  out.skipped_ids = skipped_ids(skipped);
  for (const auto& step : steps) {
    auto ids = kept(step, skipped);
    if (ids.empty()) continue;
    const RoundSearch search(samples, layouts, world_size, cost, memory, options.max_rounds);
    out.steps.push_back(make_step(options, static_cast<int64_t>(out.steps.size()), search.plan(std::move(ids))));
  }
  return out;
}

}  // namespace dcp
