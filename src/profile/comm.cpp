#include "profile/comm.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <stdexcept>

#include "profile/over_ranks.h"
#include "util/clock.h"
#include "util/logging.h"
#include "util/stats.h"

namespace dcp {

namespace {

// Median seconds of `call` after three warm-up calls (Gloo's buffers for this size, and the first calls after
// seconds of compute, which run 10-50x slower than the next ones), each timed call after a barrier of the group:
// without it a call would also time its peer's lateness from the previous one.
double median_call_seconds(const Communicator& group, const std::function<void()>& call, int64_t repeats) {
  for (int i = 0; i < 3; ++i) call();
  std::vector<double> times;
  for (int64_t i = 0; i < repeats; ++i) {
    group.barrier();
    const auto start = std::chrono::steady_clock::now();
    call();
    times.push_back(seconds_since(start));
  }
  return median(times);
}

void check_comm_grid(const char* what, int64_t sp, const std::vector<int64_t>& local_tokens, int64_t repeats,
                     bool divisible, int64_t hidden) {
  if (local_tokens.empty() || repeats < 1 || !divisible ||
      std::any_of(local_tokens.begin(), local_tokens.end(), [](int64_t t) { return t < 1; })) {
    throw std::invalid_argument(fmt::format("SP profile ({}): needs local token counts >= 1 ({} given), repeats >= 1 "
                                            "(got {}) and hidden {} divisible by sp_size {}",
                                            what, local_tokens.size(), repeats, hidden, sp));
  }
}

// The points' measured_s from this rank's medians (mean over the ranks), then the fit.
SpProfile finish(const Communicator& world, SpProfile result, const std::vector<double>& medians) {
  const std::vector<double> mean = over_ranks(world, medians).mean;
  for (size_t i = 0; i < result.points.size(); ++i) result.points[i].measured_s = mean[i];
  fit_all_to_all(result);
  return result;
}

}  // namespace

SpProfile profile_all_to_all(const Communicator& world, const Communicator& group, const ModelShape& shape,
                               at::ScalarType dtype, const std::vector<int64_t>& local_tokens, int64_t repeats) {
  const int64_t sp = group.size();
  check_comm_grid("all-to-all", sp, local_tokens, repeats, shape.hidden % sp == 0, shape.hidden);
  SpProfile result;
  result.sp_size = sp;
  const double leaving = static_cast<double>(sp - 1) / static_cast<double>(sp);
  std::vector<double> medians;
  for (int64_t tokens : local_tokens) {
    for (int64_t width : {int64_t{3}, int64_t{1}}) {
      CommPoint p;
      p.local_tokens = tokens;
      p.width = width;
      p.bytes_leaving_rank = static_cast<double>(tokens * width * shape.hidden * shape.bytes_per_element) * leaving;
      p.held_out = result.points.size() % 3 == 2;
      const at::Tensor x = at::zeros({sp, tokens, width, shape.hidden / sp}, at::TensorOptions().dtype(dtype));
      medians.push_back(median_call_seconds(group, [&] { group.all_to_all(x); }, repeats));
      result.points.push_back(p);
    }
  }
  return finish(world, std::move(result), medians);
}

SpProfile profile_ring_exchange(const Communicator& world, const Communicator& group, const ModelShape& shape,
                                at::ScalarType dtype, const std::vector<int64_t>& local_tokens, int64_t repeats) {
  const int64_t sp = group.size(), me = group.rank();
  check_comm_grid("ring", sp, local_tokens, repeats, true, shape.hidden);
  SpProfile result;
  result.sp_size = sp;
  const auto kv_dim = static_cast<int64_t>(shape.kv_dim());
  std::vector<double> medians;
  for (int64_t tokens : local_tokens) {
    CommPoint p;
    p.local_tokens = tokens;
    p.width = 2;  // K and V
    p.bytes_leaving_rank = static_cast<double>(2 * tokens * kv_dim * shape.bytes_per_element);
    p.held_out = result.points.size() % 3 == 2;
    const at::Tensor block = at::zeros({2, tokens, kv_dim}, at::TensorOptions().dtype(dtype));
    medians.push_back(median_call_seconds(
        group, [&] { group.exchange(block, (me + 1) % sp, (me + sp - 1) % sp).wait(); }, repeats));
    result.points.push_back(p);
  }
  return finish(world, std::move(result), medians);
}

void fit_all_to_all(SpProfile& sp) {
  std::vector<std::vector<double>> rows;
  std::vector<double> targets;
  double fastest_rate = 0;  // bytes per second
  for (const CommPoint& p : sp.points) {
    if (p.held_out) continue;
    if (!(p.measured_s > 0) || !(p.bytes_leaving_rank > 0) || !std::isfinite(p.measured_s) ||
        !std::isfinite(p.bytes_leaving_rank)) {
      throw std::invalid_argument(fmt::format("all-to-all fit of sp_size {}: a point of {} bytes measured {} s "
                                              "(both must be positive and finite)",
                                              sp.sp_size, p.bytes_leaving_rank, p.measured_s));
    }
    rows.push_back({1.0 / p.measured_s, p.bytes_leaving_rank / p.measured_s});
    targets.push_back(1.0);
    fastest_rate = std::max(fastest_rate, p.bytes_leaving_rank / p.measured_s);
  }
  if (rows.empty()) {
    throw std::invalid_argument(fmt::format("all-to-all fit of sp_size {}: no point to fit ({} held out)",
                                            sp.sp_size, sp.points.size()));
  }
  const std::vector<double> coef = fit_nonnegative_least_squares(rows, targets);
  sp.bandwidth_fitted = coef[1] > 0;
  if (sp.bandwidth_fitted) {
    sp.fit.latency_s = coef[0];
    sp.fit.bytes_per_s = 1.0 / coef[1];
  } else {
    sp.fit.bytes_per_s = fastest_rate;
    std::vector<std::vector<double>> latency_rows;
    std::vector<double> latency_targets;
    std::string measured;
    for (const CommPoint& p : sp.points) {
      measured += fmt::format("{}{:.0f} B {:.3f} ms", measured.empty() ? "" : ", ", p.bytes_leaving_rank,
                              1e3 * p.measured_s);
      if (p.held_out) continue;
      latency_rows.push_back({1.0 / p.measured_s});
      latency_targets.push_back(1.0 - p.bytes_leaving_rank / fastest_rate / p.measured_s);
    }
    sp.fit.latency_s = fit_nonnegative_least_squares(latency_rows, latency_targets)[0];
    spdlog::warn("SP profile: the all-to-all times of sp_size {} do not grow with the bytes sent (too noisy for "
                 "a bandwidth fit); fitted the latency alone, {:.1f} us, with the fastest measured rate, {:.3f} "
                 "GB/s, as the bandwidth. Measured (bytes leaving a rank, median time per call): {}. Rerun `dcp "
                 "profile` on an idle machine for a better fit",
                 sp.sp_size, 1e6 * sp.fit.latency_s, sp.fit.bytes_per_s / 1e9, measured);
  }
  std::vector<double> errors;
  std::vector<bool> held_out;
  for (CommPoint& p : sp.points) {
    p.predicted_s = sp.fit.latency_s + p.bytes_leaving_rank / sp.fit.bytes_per_s;
    errors.push_back(std::abs(p.predicted_s - p.measured_s) / p.measured_s);
    held_out.push_back(p.held_out);
  }
  const SplitErrors e = split_errors(errors, held_out);
  sp.heldout_median_error = e.heldout_median;
  sp.heldout_max_error = e.heldout_max;
  sp.fit_median_error = e.fit_median;
}

}  // namespace dcp
