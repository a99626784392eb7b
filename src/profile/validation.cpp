#include "profile/validation.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "dcp/sequence_parallel.h"
#include "profile/over_ranks.h"
#include "profile/runs.h"
#include "util/stats.h"

namespace dcp {

std::vector<ValidationPoint> validate_sequence_parallel(Transformer& model, const Communicator& world,
                                                        const Communicator& group, const Config& cfg,
                                                        const std::vector<int64_t>& lengths, int64_t min_tokens,
                                                        int64_t repeats, double long_point_s) {
  const int64_t sp = group.size();
  std::vector<ValidationPoint> points;
  std::vector<double> times, peaks;  // this rank's, by point
  // Seeded alike on every rank, so that the shards of one micro-batch are of the same samples.
  std::mt19937_64 rng(static_cast<uint64_t>(cfg.run.seed) + static_cast<uint64_t>(sp));
  const auto attention = std::make_shared<SequenceParallelAttention>(group);
  for (size_t i = 0; i < lengths.size(); ++i) {
    const int64_t length = lengths[i];
    if (length < sp || length % sp != 0 || length > cfg.data.max_seq_len) {
      throw std::invalid_argument(fmt::format("SP validation: length {} must be a positive multiple of sp_size {} "
                                              "and at most data.max_seq_len {}",
                                              length, sp, cfg.data.max_seq_len));
    }
    const std::vector<int64_t> sample_lengths(static_cast<size_t>(std::max<int64_t>(1, min_tokens / length)), length);
    const Corpus corpus = random_corpus(sample_lengths, cfg.data, rng);
    std::vector<int64_t> ids(sample_lengths.size());
    for (size_t k = 0; k < ids.size(); ++k) ids[k] = static_cast<int64_t>(k);
    PackedBatch shard = make_shard(corpus, ids, group.rank(), sp);
    shard.attention = attention;
    const int64_t recompute[] = {0, cfg.model.n_layers};
    for (size_t j = 0; j < 2; ++j) {
      ValidationPoint p;
      p.sp_size = sp;
      p.lengths = sample_lengths;
      p.recompute_layers = recompute[j];
      p.held_out = (i + j) % 2 == 1;
      const Timing t = time_backward(
          model, [&] { return model->loss_sum(shard, p.recompute_layers); }, world, group, repeats, long_point_s);
      times.push_back(t.median_s);
      peaks.push_back(t.peak_bytes);
      points.push_back(p);
    }
  }
  // One collective for both: the times' means and the peaks' maxima.
  const size_t n = points.size();
  times.insert(times.end(), peaks.begin(), peaks.end());
  const OverRanks all = over_ranks(world, times);
  for (size_t i = 0; i < n; ++i) {
    points[i].measured_s = all.mean[i];
    points[i].measured_peak_bytes = all.max[n + i];
  }
  return points;
}

void fit_sp_overhead(SpProfile& sp, std::vector<ValidationPoint>& points, const ModelShape& shape,
                     DeviceSpec& device, const MemoryModel& memory) {
  const auto fit = device.all_to_all.find(sp.sp_size);
  if (points.empty() || fit == device.all_to_all.end()) {
    throw std::invalid_argument(fmt::format("SP overhead fit of sp_size {}: needs validation points ({} given) and "
                                            "the size's all-to-all fit",
                                            sp.sp_size, points.size()));
  }
  fit->second.overhead_s_per_byte = 0;
  const CostModel without(shape, device);
  std::vector<std::vector<double>> rows;
  std::vector<double> targets;
  for (const ValidationPoint& p : points) {
    if (p.held_out) continue;
    const int64_t tokens = std::accumulate(p.lengths.begin(), p.lengths.end(), int64_t{0});
    const double bytes = without.all_to_all_bytes(tokens, p.sp_size, p.recompute_layers);
    rows.push_back({bytes / p.measured_s});
    targets.push_back(1.0 - without.seconds(p.lengths, p.sp_size, p.recompute_layers) / p.measured_s);
  }
  const double overhead = fit_nonnegative_least_squares(rows, targets)[0];  // point 0 is never held out
  fit->second.overhead_s_per_byte = overhead;
  sp.fit.overhead_s_per_byte = overhead;

  const CostModel with(shape, device);
  std::vector<double> errors;
  std::vector<bool> held_out;
  for (ValidationPoint& p : points) {
    p.predicted_s = with.seconds(p.lengths, p.sp_size, p.recompute_layers);
    p.predicted_peak_bytes = memory.bytes(p.lengths, p.sp_size, p.recompute_layers);
    errors.push_back(std::abs(p.predicted_s - p.measured_s) / p.measured_s);
    held_out.push_back(p.held_out);
  }
  const SplitErrors e = split_errors(errors, held_out);
  sp.validation_heldout_median_error = e.heldout_median;
  sp.validation_heldout_max_error = e.heldout_max;
  sp.validation_fit_median_error = e.fit_median;
}

namespace {
double local_tokens(const ValidationPoint& p) {
  return static_cast<double>(std::accumulate(p.lengths.begin(), p.lengths.end(), int64_t{0})) /
         static_cast<double>(p.sp_size);
}
}  // namespace

double fit_sp_token_bytes(std::vector<ValidationPoint>& points, const ModelShape& shape,
                          MemoryCoefficients coefficients) {
  if (points.empty()) throw std::invalid_argument("SP memory fit: no validation points");
  coefficients.sp_token_bytes = 0;
  const MemoryModel without(shape, coefficients, 1.0);
  double largest = 0;
  for (const ValidationPoint& p : points) {
    if (p.sp_size < 2) {
      throw std::invalid_argument(fmt::format("SP memory fit: a validation point of sp_size {}", p.sp_size));
    }
    largest = std::max(largest, local_tokens(p));
  }
  double e = 0;
  for (const ValidationPoint& p : points) {
    const double local = local_tokens(p);
    if (local < largest / 2) continue;
    e = std::max(e, (p.measured_peak_bytes - without.bytes(p.lengths, p.sp_size, p.recompute_layers)) / local);
  }
  coefficients.sp_token_bytes = e;
  const MemoryModel with(shape, coefficients, 1.0);
  for (ValidationPoint& p : points) p.predicted_peak_bytes = with.bytes(p.lengths, p.sp_size, p.recompute_layers);
  return e;
}

}  // namespace dcp
