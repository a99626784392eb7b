// profile_model (dcp/profiler.h): the sp-1 compute grid and its time and memory fits, then, under
// `dcp launch`, the all-to-all fits (train/profile_comm.h) and the SP validation (train/profile_validation.h).
#include "profile/profiler.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>
#include <stdexcept>

#include "dcp/data.h"
#include "dcp/memory_meter.h"
#include "dcp/model.h"
#include "dcp/planning.h"
#include "dcp/precision.h"
#include "profile/comm.h"
#include "profile/over_ranks.h"
#include "profile/round_switch.h"
#include "profile/runs.h"
#include "profile/validation.h"
#include "runtime/optimizer.h"
#include "util/clock.h"
#include "util/logging.h"
#include "util/stats.h"

namespace dcp {

namespace {

double max_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) * 1024.0;  // Linux reports kilobytes
}

double physical_memory_bytes() {
  return static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
}

// Sum of squared sample lengths of a point, tokens^2.
double squares(const ProfilePoint& p) {
  double q = 0;
  for (int64_t len : p.lengths) q += static_cast<double>(len) * static_cast<double>(len);
  return q;
}

// first, 2 first, 4 first, ... below `last`, then `last`.
std::vector<int64_t> doubling_up_to(int64_t first, int64_t last) {
  std::vector<int64_t> out;
  for (int64_t v = first; v < last; v *= 2) out.push_back(v);
  out.push_back(last);
  return out;
}

// Default ProfileOptions::sample_lengths, ascending: longest / 4^k down to 128, or longest, / 2 and / 4 when that
// gives fewer than three. Spacing by 4 rather than 2 halves the grid (the s^2 term needs only a few lengths, and
// the long ones dominate the profile's time); with fewer than three lengths the linear and attention FLOPs are
// too close to proportional for the fit to tell them apart.
std::vector<int64_t> default_sample_lengths(int64_t longest) {
  std::vector<int64_t> out{longest};
  while (out.back() / 4 >= 128) out.push_back(out.back() / 4);
  if (out.size() < 3) {
    out = {longest};
    for (int64_t len = longest / 2; len >= 1 && out.size() < 3; len /= 2) out.push_back(len);
  }
  return {out.rbegin(), out.rend()};
}

// The grids of ProfileOptions with its defaults filled in for this config.
struct Grid {
  int64_t max_length = 0;
  std::vector<int64_t> lengths, micro_batch_tokens;
};

Grid resolve_grid(const Config& cfg, const ProfileOptions& options, int64_t largest_sp_size) {
  if (options.repeats < 1 || options.comm_repeats < 1 || !(options.long_point_s > 0) || options.max_length < 0) {
    throw std::invalid_argument(fmt::format("profile: repeats {} and comm_repeats {} must be >= 1, long_point_s {} "
                                            "> 0 and max_length {} >= 0",
                                            options.repeats, options.comm_repeats, options.long_point_s,
                                            options.max_length));
  }
  Grid g;
  g.max_length = options.max_length > 0 ? options.max_length : cfg.data.max_seq_len;
  const int64_t shortest = min_profile_max_length(largest_sp_size);
  if (g.max_length < shortest || g.max_length > cfg.data.max_seq_len) {
    throw std::invalid_argument(fmt::format("profile: max_length {} is outside [{}, data.max_seq_len {}] (the "
                                            "shortest the grids can be built from with SP sizes up to {})",
                                            g.max_length, shortest, cfg.data.max_seq_len, largest_sp_size));
  }
  const std::vector<int64_t> lengths =
      options.sample_lengths.empty() ? default_sample_lengths(g.max_length) : options.sample_lengths;
  for (int64_t len : lengths) {
    if (len >= 1 && len <= cfg.data.max_seq_len) g.lengths.push_back(len);
  }
  g.micro_batch_tokens = options.micro_batch_tokens;
  if (g.micro_batch_tokens.empty()) {
    const int64_t top = std::max(g.max_length, cfg.train.micro_batch_tokens);
    g.micro_batch_tokens = {std::max<int64_t>(1, top / 8), top};
  }
  if (g.lengths.empty()) {
    throw std::invalid_argument(
        fmt::format("profile: no grid sample length fits data.max_seq_len {}", cfg.data.max_seq_len));
  }
  return g;
}

// The memory fit of profile_model (its doc comment): relative residuals over the points not held out.
void fit_memory(ProfileResult& result) {
  const double L = static_cast<double>(result.shape.layers);
  // Only operators that materialise per-sample score matrices get the s^2 terms; for the tiled softmax and the
  // chunked linear forms they would only fit noise.
  const ModelShape& shape = result.shape;
  const bool quadratic = shape.attention == AttentionKind::kSoftmaxReference ||
                         (shape.attention == AttentionKind::kLinear && shape.chunk_size == 0);
  std::vector<std::vector<double>> rows;
  std::vector<double> targets;
  for (const ProfilePoint& p : result.points) {
    if (p.held_out) continue;
    const double t = static_cast<double>(p.tokens), q = squares(p), r = static_cast<double>(p.recompute_layers);
    const double m = p.measured_peak_bytes;
    rows.push_back({1.0 / m, t * (L - r) / m, t * r / m});
    if (quadratic) {
      rows.back().push_back(q * (L - r) / m);
      rows.back().push_back(q / m);
    }
    targets.push_back(1.0);
  }
  std::vector<double> x = fit_nonnegative_least_squares(rows, targets);
  x.resize(5, 0.0);
  if (!(x[1] > 0 || x[2] > 0)) {
    throw std::runtime_error(fmt::format(
        "profile: the memory fit found no bytes per token (measured peaks, by the {}, do not grow with the "
        "micro-batch)",
        result.memory_method));
  }
  MemoryCoefficients& c = result.memory;
  c.base_bytes = x[0];
  c.token_layer_bytes = x[1];
  c.token_recompute_bytes = x[2];
  c.token_bytes = 0;  // not separable from a and b: c t = (c / L) (t (L - r) + t r)
  c.square_layer_bytes = x[3];
  c.square_bytes = x[4];
  // Not fitted (the SP validation's peaks show how close it is): the q, k, v stack and send copy of Ulysses
  // (MemoryCoefficients).
  c.sp_token_bytes = 6.0 * static_cast<double>(result.shape.hidden * result.shape.bytes_per_element);

  const MemoryModel fitted(result.shape, c, result.device.memory_bytes);
  std::vector<double> errors;
  std::vector<bool> held_out;
  for (ProfilePoint& p : result.points) {
    p.predicted_peak_bytes = fitted.bytes(p.lengths, 1, p.recompute_layers);
    errors.push_back(std::abs(p.predicted_peak_bytes - p.measured_peak_bytes) / p.measured_peak_bytes);
    held_out.push_back(p.held_out);
  }
  const SplitErrors e = split_errors(errors, held_out);
  result.memory_heldout_median_error = e.heldout_median;
  result.memory_heldout_max_error = e.heldout_max;
  result.memory_fit_median_error = e.fit_median;
}

}  // namespace

void fit_profile_time(ProfileResult& result) {
  std::vector<std::vector<double>> rows;
  std::vector<double> targets;
  for (const ProfilePoint& p : result.points) {
    if (p.held_out) continue;
    rows.push_back({1.0 / p.measured_s, p.flops.linear / p.measured_s, p.flops.attention / p.measured_s});
    targets.push_back(1.0);
  }
  std::vector<double> coef = fit_nonnegative_least_squares(rows, targets);
  // Both rates must come out positive. Where attention's FLOPs grow like the linear ones (a linear-attention
  // model, short samples), the two columns are nearly collinear and the fit may put all the time on either;
  // before, a zero linear coefficient beside a positive attention one was refused as "no cost per FLOP" (about
  // half the automatic profiles of a tiny Flexformer model, by the noise of the measurements).
  // A coefficient that carries less than 0.1% of any point's predicted time is 0 in effect (the fit's subsets
  // tie to rounding between an exact 0 and a tiny positive rate).
  auto carries_time = [&](size_t k) {
    double most = 0;
    for (const auto& row : rows) most = std::max(most, coef[k] * row[k]);  // rows are x / measured: a share of 1
    return most >= 1e-3;
  };
  result.attention_separated = carries_time(1) && carries_time(2);
  if (!result.attention_separated) {
    // The grid does not separate attention from the linear terms: one rate for all FLOPs.
    for (auto& row : rows) row = {row[0], row[1] + row[2]};
    const std::vector<double> joint = fit_nonnegative_least_squares(rows, targets);
    coef = {joint[0], joint[1], joint[1]};
  }
  if (!(coef[1] > 0) || !carries_time(1)) {
    throw std::runtime_error(
        "profile: the fit found no cost per FLOP (measured times do not grow with the micro-batch's FLOPs, as for "
        "a model so small that fixed costs dominate); rerun with more repeats on an idle machine (`dcp profile "
        "--repeats N`), or plan with the analytic cost model (`--train.cost_model=h200`) instead of a profile");
  }
  result.fixed_s = coef[0];
  result.linear_flops_per_s = 1.0 / coef[1];
  result.attention_flops_per_s = 1.0 / coef[2];

  DeviceSpec& d = result.device;
  d.name = "cpu-profile";
  d.peak_flops = result.linear_flops_per_s;
  d.mfu = 1.0;
  d.attention_mfu = result.attention_flops_per_s / result.linear_flops_per_s;
  d.micro_batch_overhead_s = result.fixed_s;
  d.memory_bytes = physical_memory_bytes();
  d.gpus_per_node = 1;

  const CostModel fitted(result.shape, d);
  std::vector<double> errors;
  std::vector<bool> held_out;
  for (ProfilePoint& p : result.points) {
    p.predicted_s = fitted.seconds(p.lengths, 1, p.recompute_layers);
    errors.push_back(std::abs(p.predicted_s - p.measured_s) / p.measured_s);
    held_out.push_back(p.held_out);
  }
  const SplitErrors e = split_errors(errors, held_out);
  result.heldout_median_error = e.heldout_median;
  result.heldout_max_error = e.heldout_max;
  result.fit_median_error = e.fit_median;
}

namespace {

// The points of the compute grid: per length, the (tokens, recompute) combinations rotated by the length's
// index; a combination that repeats an earlier point of its length (tokens / length rounding to the same
// sample count) is dropped.
std::vector<ProfilePoint> grid_points(const Grid& g, int64_t n_layers, const CostModel& flop_model) {
  struct Combo {
    int64_t tokens, recompute;
  };
  std::vector<Combo> combos;
  for (int64_t t : g.micro_batch_tokens)
    for (int64_t r : {int64_t{0}, n_layers}) combos.push_back({t, r});
  std::vector<ProfilePoint> points;
  for (size_t li = 0; li < g.lengths.size(); ++li) {
    const size_t first_of_length = points.size();
    for (size_t j = 0; j < combos.size(); ++j) {
      const Combo& c = combos[(j + li) % combos.size()];
      ProfilePoint p;
      p.lengths.assign(static_cast<size_t>(std::max<int64_t>(1, c.tokens / g.lengths[li])), g.lengths[li]);
      p.recompute_layers = c.recompute;
      const bool repeated = std::any_of(points.begin() + static_cast<long>(first_of_length), points.end(),
                                        [&](const ProfilePoint& q) {
                                          return q.lengths == p.lengths && q.recompute_layers == p.recompute_layers;
                                        });
      if (repeated) continue;
      p.tokens = g.lengths[li] * static_cast<int64_t>(p.lengths.size());
      p.flops = flop_model.flops(p.lengths, p.recompute_layers);
      p.held_out = points.size() % 4 == 3;
      points.push_back(std::move(p));
    }
  }
  return points;
}

// ProfileOptions::comm_local_tokens for sp ranks; default 64, 128, ... up to the grid's largest micro-batch / sp,
// and at least to calls of kCommBytes.
std::vector<int64_t> comm_tokens(const Grid& g, const ProfileOptions& options, const ModelShape& shape,
                                 int64_t sp) {
  if (!options.comm_local_tokens.empty()) return options.comm_local_tokens;
  // Below a few MB per call a call's time is mostly latency and noise; the bandwidth needs larger ones.
  constexpr int64_t kCommBytes = int64_t{4} << 20;
  const int64_t largest = std::max(g.max_length, *std::max_element(g.micro_batch_tokens.begin(),
                                                                   g.micro_batch_tokens.end()));
  const int64_t bytes_per_token = 3 * shape.hidden * shape.bytes_per_element;  // the stacked q, k, v
  return doubling_up_to(64, std::max({int64_t{128}, largest / sp, kCommBytes / bytes_per_token}));
}

// ProfileOptions::validation_lengths for sp ranks; default max_length / 16, / 8, ... / 1 as multiples of sp.
std::vector<int64_t> validation_lengths(const Grid& g, const ProfileOptions& options, int64_t sp) {
  if (!options.validation_lengths.empty()) return options.validation_lengths;
  std::vector<int64_t> out;
  for (int64_t len : {g.max_length / 16, g.max_length / 8, g.max_length / 4, g.max_length / 2, g.max_length}) {
    const int64_t multiple = std::max(sp, len / sp * sp);
    if (multiple <= g.max_length && std::find(out.begin(), out.end(), multiple) == out.end()) out.push_back(multiple);
  }
  return out;
}

// The SP sizes above 1 that profile_model profiles: those of parallel.sp_sizes (what the cache key names), not
// every group the caller made (the trainer's also serve parallel.sp_size and plan files). Ulysses shards heads,
// so a size that does not divide them cannot run this model and no planner chooses it: skipped, with a warning.
std::vector<int64_t> profiled_sp_sizes(const ParallelConfig& parallel, const ModelConfig& model, const Communicator& world) {
  const std::vector<int64_t> usable = usable_sp_sizes(parallel.sp_sizes, world.size(), model.kv_heads());
  std::vector<int64_t> skipped, out;
  for (int64_t sp : resolve_sp_sizes(parallel.sp_sizes, world.size())) {
    if (std::find(usable.begin(), usable.end(), sp) == usable.end()) {
      skipped.push_back(sp);
    } else if (sp > 1) {
      out.push_back(sp);
    }
  }
  if (!skipped.empty() && world.rank() == 0) {
    spdlog::warn("profile: {} SP size(s) of parallel.sp_sizes '{}' not profiled: {} do(es) not divide "
                 "model.n_heads {} (Ulysses shards the heads over a group; their ring steps are profiled for the "
                 "ring modes, which have no such bound)",
                 skipped.size(), parallel.sp_sizes, fmt::join(skipped, ", "), model.n_heads);
  }
  return out;
}

}  // namespace

int64_t min_profile_max_length(int64_t largest_sp_size) { return std::max<int64_t>(4, largest_sp_size); }

int64_t min_profile_max_length(const ParallelConfig& parallel, const ModelConfig& model, int64_t world_size) {
  return min_profile_max_length(
      world_size > 1 ? usable_sp_sizes(parallel.sp_sizes, world_size, model.kv_heads()).back() : 1);
}

ProfileResult profile_model(const Config& cfg, const ProcessGroups* groups, const ProfileOptions& options) {
  const auto wall_start = std::chrono::steady_clock::now();
  const Communicator self("self", 0, 1, nullptr);
  const Communicator& world = groups ? groups->world() : self;
  const std::vector<int64_t> sp_sizes = groups ? profiled_sp_sizes(cfg.parallel, cfg.model, world) : std::vector<int64_t>{};
  // Ring steps at every size above 1 of parallel.sp_sizes (a ring does not shard heads), for softmax only.
  std::vector<int64_t> ring_sizes;
  if (groups && cfg.attention.backend == "softmax") {
    for (int64_t sp : resolve_sp_sizes(cfg.parallel.sp_sizes, world.size())) {
      if (sp > 1) ring_sizes.push_back(sp);
    }
  }
  const Grid grid = resolve_grid(cfg, options, sp_sizes.empty() ? 1 : sp_sizes.back());

  ProfileResult result;
  const Precision precision = resolve_precision(cfg.train.precision).precision;
  result.shape = model_shape_of(cfg, activation_bytes(precision));
  result.repeats = options.repeats;
  result.world_size = world.size();
  result.threads = threads_per_rank(cfg.train, groups ? groups->env() : DistEnv{});
  torch::set_num_threads(static_cast<int>(result.threads));
  torch::manual_seed(cfg.run.seed);
  Transformer model(cfg.model, cfg.attention, precision);
  model->train();
  const CostModel flop_model(result.shape, DeviceSpec{});
  // The trainer's resident state during forward+backward: weights, gradients (zeroed in place between runs
  // here) and AdamW's two moments per parameter.
  result.memory_method = MemoryMeter::install();
  std::vector<torch::Tensor> optimizer_state;
  for (auto& p : model->parameters()) {
    p.mutable_grad() = torch::zeros_like(p);
    optimizer_state.push_back(torch::zeros_like(p));
    optimizer_state.push_back(torch::zeros_like(p));
  }

  // Every rank runs the whole grid at the same time, as ranks of the trainer compute at the same time (they
  // share the memory bandwidth); the fits see each point's mean time and max peak over the ranks.
  result.points = grid_points(grid, cfg.model.n_layers, flop_model);
  std::mt19937_64 rng(static_cast<uint64_t>(cfg.run.seed));
  std::vector<double> times, peaks;
  for (const ProfilePoint& p : result.points) {
    const Corpus corpus = random_corpus(p.lengths, cfg.data, rng);
    std::vector<int64_t> ids(p.lengths.size());
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int64_t>(i);
    const PackedBatch batch = make_batch(corpus, ids);
    const int64_t r = p.recompute_layers;
    const Timing t = time_backward(
        model, [&] { return model->loss_sum(batch, r); }, world, world, options.repeats, options.long_point_s);
    times.push_back(t.median_s);
    peaks.push_back(t.peak_bytes);
  }
  const size_t n = result.points.size();
  times.insert(times.end(), peaks.begin(), peaks.end());
  const OverRanks measured = over_ranks(world, times);
  for (size_t i = 0; i < n; ++i) {
    result.points[i].measured_s = measured.mean[i];
    result.points[i].measured_peak_bytes = measured.max[n + i];
  }
  fit_profile_time(result);
  fit_memory(result);

  if (groups) {
    const at::ScalarType dtype = compute_dtype(precision);
    for (int64_t sp : sp_sizes) {
      result.sequence_parallel.push_back(profile_all_to_all(world, groups->group(sp), result.shape, dtype,
                                                            comm_tokens(grid, options, result.shape, sp), options.comm_repeats));
      result.device.all_to_all[sp] = result.sequence_parallel.back().fit;
    }
    // Ring steps: every size of the groups, those beyond the heads too (a ring does not shard heads).
    for (int64_t sp : ring_sizes) {
      result.ring.push_back(profile_ring_exchange(world, groups->group(sp), result.shape, dtype,
                                                  comm_tokens(grid, options, result.shape, sp), options.comm_repeats));
      result.device.ring[sp] = result.ring.back().fit;
    }
    const MemoryModel memory(result.shape, result.memory, result.device.memory_bytes);
    for (SpProfile& sp : result.sequence_parallel) {
      std::vector<ValidationPoint> v =
          validate_sequence_parallel(model, world, groups->group(sp.sp_size), cfg,
                                     validation_lengths(grid, options, sp.sp_size),
                                     *std::min_element(grid.micro_batch_tokens.begin(), grid.micro_batch_tokens.end()),
                                     options.repeats, options.long_point_s);
      fit_sp_overhead(sp, v, result.shape, result.device, memory);
      result.validation.insert(result.validation.end(), v.begin(), v.end());
    }
    if (!result.validation.empty()) {
      result.memory.sp_token_bytes = fit_sp_token_bytes(result.validation, result.shape, result.memory);
    }
    if (!sp_sizes.empty()) {
      // From sp-1 groups to the largest group, each rank holding what the shortest validation micro-batch gives
      // it: the switch a step of rounds pays where planners use them (long samples on large groups after short
      // ones alone).
      const int64_t sp = sp_sizes.back();
      const int64_t local = std::max<int64_t>(1, validation_lengths(grid, options, sp).front() / sp);
      result.round_switch = profile_round_switch(model, world, groups->group(sp), cfg, local, options.comm_repeats);
      result.device.round_switch_s = result.round_switch.switch_s;
    }
  }
  result.max_rss_bytes = over_ranks(world, {max_rss_bytes()}).max[0];
  result.wall_s = seconds_since(wall_start);
  return result;
}

}  // namespace dcp
