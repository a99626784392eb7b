// Planner registry, step evaluation and the lower bound.
#include "dcp/planners.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>
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
  const int64_t rounds = plan.num_rounds();
  c.round_makespan_s.assign(static_cast<size_t>(rounds), 0.0);
  double busy = 0;
  for (const auto& g : plan.groups) {
    double t = 0;
    for (const auto& mb : g.micro_batches) {
      std::vector<int64_t> lengths;
      for (int64_t id : mb.sample_ids) lengths.push_back(samples.at(static_cast<size_t>(id)).length);
      t += cost.seconds(lengths, g.layout(), mb.recompute_layers);
      c.peak_bytes = std::max(c.peak_bytes, memory.bytes(mb.num_tokens, g.sp_size, mb.recompute_layers));
    }
    double& round = c.round_makespan_s.at(static_cast<size_t>(g.round));
    round = std::max(round, t);
    busy += t * static_cast<double>(g.sp_size);
  }
  for (double m : c.round_makespan_s) c.makespan_s += m;
  c.mean_rank_s = busy / static_cast<double>(world_size);
  c.step_s = c.makespan_s + cost.round_seconds(rounds) + cost.step_seconds(world_size);
  return c;
}

namespace {

// The smallest M with M >= (1 / k) * sum of `big[i]` over the samples i with `small[i]` > M (samples that must run
// on a group of more than W / (k + 1) ranks, where at most k such groups run at once): the samples by `small`
// descending, M in each interval between two of them.
double big_sample_bound(std::vector<std::pair<double, double>> small_big, int64_t k) {
  std::sort(small_big.begin(), small_big.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  double best = kInf, sum = 0;
  const size_t n = small_big.size();
  for (size_t j = 0; j <= n; ++j) {  // the first j samples are big: M in [small[j], small[j - 1])
    const double lo = j < n ? small_big[j].first : 0.0, hi = j > 0 ? small_big[j - 1].first : kInf;
    const double m = std::max(sum / static_cast<double>(k), lo);
    if (m <= hi) best = std::min(best, m);
    if (j < n) sum += small_big[j].second;
  }
  return best;
}

// The smallest M such that sum_i c_i(M) <= world * M, where c_i(M) is the least GPU-seconds of sample i over its
// options (t, g) with t <= M (t: the least time it takes on a layout, g: the least GPU-seconds it spends there):
// in a plan of makespan M every sample runs on some layout in a round no longer than M, so it takes one of its
// options with t <= M, and all of them together spend at most world * M GPU-seconds. c_i is a step function of
// M that falls at some of its options' times, so M is found by one sweep over those falls in time order. kInf when
// a sample has no option.
double timed_gpu_seconds_bound(std::vector<std::vector<std::pair<double, double>>> options, double world) {
  struct Fall {
    double t, c;  // from time t on, the sample's least GPU-seconds is c
    size_t i;
  };
  std::vector<Fall> falls;
  std::vector<double> cur(options.size(), kInf);
  double start = 0;  // no M below the longest of the samples' least times is feasible
  for (size_t i = 0; i < options.size(); ++i) {
    auto& o = options[i];
    if (o.empty()) return kInf;
    std::sort(o.begin(), o.end());
    double least = kInf;
    for (const auto& [t, g] : o) {
      if (g < least) falls.push_back({t, g, i}), least = g;
    }
    start = std::max(start, o.front().first);
  }
  std::sort(falls.begin(), falls.end(), [](const Fall& a, const Fall& b) { return a.t < b.t; });
  double sum = 0;
  size_t k = 0;
  for (; k < falls.size() && falls[k].t <= start; ++k) cur[falls[k].i] = falls[k].c;
  for (double c : cur) sum += c;
  double m = start;
  while (true) {
    const double next = k < falls.size() ? falls[k].t : kInf;
    const double fit = std::max(m, sum / world);  // sum is constant on [m, next)
    if (fit < next) return fit;
    for (; k < falls.size() && falls[k].t <= next; ++k) {
      sum += falls[k].c - cur[falls[k].i];
      cur[falls[k].i] = falls[k].c;
    }
    m = next;
  }
}

// The most tokens any micro-batch on sp ranks with r recomputed layers can hold: MemoryModel::max_tokens where
// the model is linear in tokens (then exact), else its linear part alone (the squared-length terms only add).
int64_t token_capacity(const MemoryModel& memory, int64_t sp, int64_t r) {
  const MemoryCoefficients& c = memory.coefficients();
  if (c.square_layer_bytes == 0 && c.square_bytes == 0) return memory.max_tokens(sp, r);
  const double L = static_cast<double>(memory.shape().layers), rr = static_cast<double>(r);
  const double per_local = c.token_layer_bytes * (L - rr) + c.token_recompute_bytes * rr + c.token_bytes +
                           (sp > 1 ? c.sp_token_bytes : 0.0);
  if (!(per_local > 0)) return std::numeric_limits<int64_t>::max();
  const double t = std::floor((memory.budget_bytes() - c.base_bytes) * static_cast<double>(sp) / per_local);
  return t < 1 ? 0 : t > 1e18 ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(t);
}

}  // namespace

std::vector<SpMode> planner_sp_modes(const std::string& planner, const std::vector<SpMode>& requested) {
  return planner == "dcp-opt" ? requested : std::vector<SpMode>{};
}

double step_lower_bound(const std::vector<int64_t>& ids, const std::vector<Sample>& samples, int64_t world_size,
                        const CostModel& cost, const MemoryModel& memory, const std::vector<SpMode>& modes) {
  check_world(world_size);
  const auto layouts = sp_layouts_allowed(world_size, cost, modes);
  const int64_t L = cost.shape().layers;
  const double overhead = cost.device().micro_batch_overhead_s;
  constexpr int64_t kBigGroups = 3;  // the big-sample bound for k = 1 .. kBigGroups groups at once
  double sum_gpu_s = 0, sum_work_s = 0, longest = 0;
  std::vector<std::vector<std::pair<double, double>>> big(kBigGroups), timed;
  timed.reserve(ids.size());
  for (int64_t id : ids) {
    const int64_t len = samples.at(static_cast<size_t>(id)).length;
    double g = kInf, f = kInf, w = kInf;
    std::vector<double> small_s(kBigGroups, kInf), big_s(kBigGroups, kInf);
    std::vector<std::pair<double, double>> options;  // per layout: (least time there, least GPU-seconds there)
    for (const SpLayout& l : layouts) {
      const int64_t s = l.sp_size;
      auto r = memory.min_recompute_layers(len, s);
      if (!r) continue;
      const double work = cost.work_seconds(len, l, *r), alone = cost.seconds({len}, l, *r);
      // Its GPU-seconds in whatever micro-batch holds it: at some recompute count q >= *r, its work there plus
      // its share (by tokens, at most the capacity at q) of that micro-batch's fixed seconds. The micro-batch
      // lasts at least its fixed seconds plus this sample's work.
      double gl = kInf, tl = alone;
      for (int64_t q = *r; q <= L; ++q) {
        const int64_t capacity = token_capacity(memory, s, q);
        if (capacity < len) continue;
        const double wq = q == *r ? work : cost.work_seconds(len, l, q), fixed = cost.fixed_seconds(l, q);
        const double share = fixed * static_cast<double>(len) / static_cast<double>(capacity);
        gl = std::min(gl, static_cast<double>(s) * (wq + share));
        tl = std::min(tl, fixed + wq);
      }
      g = std::min(g, gl);
      if (gl < kInf) options.emplace_back(tl, gl);
      w = std::min(w, static_cast<double>(s) * work);
      f = std::min(f, alone);
      for (int64_t k = 1; k <= kBigGroups; ++k) {
        const bool is_big = s * (k + 1) > world_size;
        double& slot = is_big ? big_s[static_cast<size_t>(k - 1)] : small_s[static_cast<size_t>(k - 1)];
        slot = std::min(slot, is_big ? work : alone);
      }
    }
    if (g == kInf) continue;
    timed.push_back(std::move(options));
    sum_gpu_s += g;
    sum_work_s += w;
    longest = std::max(longest, f);
    for (int64_t k = 1; k <= kBigGroups; ++k) big[static_cast<size_t>(k - 1)].emplace_back(small_s[static_cast<size_t>(k - 1)], big_s[static_cast<size_t>(k - 1)]);
  }
  const double world = static_cast<double>(world_size);
  double bound = std::max(sum_gpu_s / world, longest);
  if (!timed.empty()) bound = std::max(bound, timed_gpu_seconds_bound(std::move(timed), world));
  if (sum_work_s > 0) bound = std::max(bound, sum_work_s / world + overhead);
  for (int64_t k = 1; k <= kBigGroups && k + 1 <= world_size; ++k) {
    bound = std::max(bound, big_sample_bound(std::move(big[static_cast<size_t>(k - 1)]), k));
  }
  return bound + cost.step_seconds(world_size);
}

}  // namespace dcp
