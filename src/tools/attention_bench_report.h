// `dcp bench-attention` results: per point the useful FLOP rate, its fraction of the measured matmul peak and the
// memory ratio; per variant the log-log slopes, the ratio to softmax and the crossover length; written as
// markdown tables, a CSV and a gnuplot script. Torch-free, so its unit test builds fast.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tools/attention_bench.h"
#include "tools/matmul_peak.h"

namespace dcp {

/// Least-squares slope of log(y) against log(x): the exponent b of y ~ x^b. Throws std::invalid_argument for
/// fewer than 2 points, sizes that differ, a value <= 0, or all x equal.
double loglog_slope(const std::vector<double>& x, const std::vector<double>& y);

/// flops / seconds / 1e9, GFLOP/s. Throws std::invalid_argument when flops < 0 or seconds <= 0 (or not finite).
double achieved_gflops(double flops, double seconds);

/// A measured point's forward+backward rate: achieved_gflops(flops.forward + flops.backward, seconds); absent for
/// a skipped point or one without a FLOP count.
std::optional<double> point_gflops(const AttentionBenchPoint& p);

/// The matmul peak of `dtype` ("fp32" or "bf16"), GFLOP/s. Throws std::invalid_argument naming another dtype.
double peak_gflops(const MatmulPeak& peak, const std::string& dtype);

/// point_gflops(p) / the peak of p's dtype (the fraction of peak, 1 = the matmul rate); absent when p has no
/// rate or that peak is not positive.
std::optional<double> fraction_of_peak(const AttentionBenchPoint& p, const MatmulPeak& peak);

/// (input_bytes + peak_bytes) / io_bytes: the most bytes of tensor storage the run held, inputs included, over
/// the bytes an exact operator must hold (attention_io_bytes); 1 is the least possible for softmax. Absent for
/// a skipped point or io_bytes <= 0.
std::optional<double> memory_ratio(const AttentionBenchPoint& p);

/// Time of `p` divided by softmax's at the same length; absent unless both were measured.
std::optional<double> time_ratio_to_softmax(const std::vector<AttentionBenchPoint>& points,
                                            const AttentionBenchPoint& p);

/// The time of `variant`'s reference twin ("<variant>-reference") at `length` over `variant`'s: how many times
/// faster the tiled softmax (or a flexformer variant's fused kernel) is; absent unless both were measured there.
std::optional<double> speedup_over_reference(const std::vector<AttentionBenchPoint>& points, int64_t length,
                                             const std::string& variant = "softmax");

/// Where a variant becomes faster than softmax, over the lengths at which both were measured ("compared").
struct AttentionCrossover {
  int64_t compared = 0;          ///< lengths where both were measured
  int64_t shortest_compared = 0;  ///< the shortest and longest of them, tokens (0 when none)
  int64_t longest_compared = 0;
  /// The crossover length: the smallest compared length from which the variant is faster (time ratio < 1) at
  /// every longer compared length; absent when it is not faster at the longest compared length.
  std::optional<int64_t> from_length;
  /// Geometric interpolation between the compared length just below from_length (ratio r_a >= 1) and
  /// from_length (ratio r_b < 1): the length where the log ratio, linear in log length, crosses 0, tokens.
  /// Absent when from_length is the shortest compared length (faster everywhere compared) or absent.
  std::optional<double> interpolated;
};

/// One variant's numbers over its points.
struct AttentionVariantSummary {
  std::string variant;
  int64_t measured = 0, skipped = 0;
  /// loglog_slope of seconds against length over the measured lengths >= slope_min_length, or over all measured
  /// lengths when fewer than 2 are that long; absent with fewer than 2 measured lengths.
  std::optional<double> slope;
  /// loglog_slope of the peak of everything held (input_bytes + peak_bytes) against length over the same lengths.
  std::optional<double> memory_slope;
  int64_t slope_points = 0, slope_from = 0, slope_to = 0;  ///< how many lengths the fits used, their range
  /// The flexformer variants (not softmax-reference, which speedup_over_reference compares), when a softmax
  /// point was measured.
  std::optional<AttentionCrossover> crossover;
  std::optional<AttentionBenchPoint> longest;  ///< the longest measured point
};

/// Summarises `points` (as bench_attention returns them) per variant, in the order the variants first appear.
std::vector<AttentionVariantSummary> summarize_attention_bench(const std::vector<AttentionBenchPoint>& points,
                                                               int64_t slope_min_length = 4096);

/// Markdown: a summary table (one row per variant: slopes, crossover, and at the longest measured length the
/// time, GFLOP/s, % of peak, peak memory and memory ratio), a table of softmax against softmax-reference per
/// length (when both ran), a table per point (forward, backward and total time, ratio to softmax, GFLOP/s of
/// fwd+bwd and of each, % of the matmul peak of its dtype, peak memory, memory ratio) and a time table (rows
/// lengths, columns variants, with the ratio to softmax); skipped points appear as "skipped: <reason>".
std::string attention_bench_markdown_tables(const std::vector<AttentionBenchPoint>& points,
                                            const std::vector<AttentionVariantSummary>& summaries,
                                            const MatmulPeak& peak);

/// One line per point with a header: variant, dtype, length, status (measured|skipped), runs, forward_seconds,
/// backward_seconds, seconds, time_ratio_to_softmax, speedup_over_reference (softmax rows), forward_flops,
/// backward_flops, flops_source, gflops, fraction_of_peak, peak_bytes, input_bytes, io_bytes, memory_ratio,
/// predicted_bytes, skip_reason (quoted, last); numbers not measured are empty fields.
std::string attention_bench_csv(const std::vector<AttentionBenchPoint>& points, const MatmulPeak& peak);

/// A gnuplot script that reads `csv_path` (as attention_bench_csv writes it) and draws `png_path`: log-log
/// milliseconds against length, log-log peak MB against length (plus softmax's predicted bytes) and the % of
/// the matmul peak against length, one line per variant in `variants`.
std::string attention_bench_gnuplot_script(const std::string& csv_path, const std::string& png_path,
                                           const std::vector<std::string>& variants);

}  // namespace dcp
