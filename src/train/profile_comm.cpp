#include "train/profile_comm.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include "train/over_ranks.h"
#include "util/clock.h"
#include "util/stats.h"

namespace dcp {

SpProfile profile_all_to_all(const Communicator& world, const Communicator& group, const ModelShape& shape,
                               at::ScalarType dtype, const std::vector<int64_t>& local_tokens, int64_t repeats) {
  const int64_t sp = group.size();
  if (local_tokens.empty() || repeats < 1 || shape.hidden % sp != 0 ||
      std::any_of(local_tokens.begin(), local_tokens.end(), [](int64_t t) { return t < 1; })) {
    throw std::invalid_argument(fmt::format("SP profile: needs local token counts >= 1 ({} given), repeats >= 1 "
                                            "(got {}) and hidden {} divisible by sp_size {}",
                                            local_tokens.size(), repeats, shape.hidden, sp));
  }
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
      // The warm-up: Gloo's buffers for this size, and the first calls after seconds of compute, which run
      // 10-50x slower than the next ones.
      for (int i = 0; i < 3; ++i) group.all_to_all(x);
      std::vector<double> times;
      for (int64_t i = 0; i < repeats; ++i) {
        // Without the barrier a call would also time its peer's lateness from the previous one.
        group.barrier();
        const auto start = std::chrono::steady_clock::now();
        group.all_to_all(x);
        times.push_back(seconds_since(start));
      }
      medians.push_back(median(times));
      result.points.push_back(p);
    }
  }
  const std::vector<double> mean = over_ranks(world, medians).mean;
  std::vector<std::vector<double>> rows;
  std::vector<double> targets;
  for (size_t i = 0; i < result.points.size(); ++i) {
    CommPoint& p = result.points[i];
    p.measured_s = mean[i];
    if (p.held_out) continue;
    rows.push_back({1.0 / p.measured_s, p.bytes_leaving_rank / p.measured_s});
    targets.push_back(1.0);
  }
  const std::vector<double> coef = fit_nonnegative_least_squares(rows, targets);
  if (!(coef[1] > 0)) {
    throw std::runtime_error(fmt::format(
        "SP profile: the all-to-all fit of sp_size {} found no cost per byte (times do not grow with the bytes "
        "sent); rerun on an idle machine",
        sp));
  }
  result.fit.latency_s = coef[0];
  result.fit.bytes_per_s = 1.0 / coef[1];
  std::vector<double> errors;
  std::vector<bool> held_out;
  for (CommPoint& p : result.points) {
    p.predicted_s = result.fit.latency_s + p.bytes_leaving_rank / result.fit.bytes_per_s;
    errors.push_back(std::abs(p.predicted_s - p.measured_s) / p.measured_s);
    held_out.push_back(p.held_out);
  }
  const SplitErrors e = split_errors(errors, held_out);
  result.heldout_median_error = e.heldout_median;
  result.heldout_max_error = e.heldout_max;
  result.fit_median_error = e.fit_median;
  return result;
}

}  // namespace dcp
