// `dcp bench-attention` results: per-variant log-log slope, ratio to softmax and crossover length, written as
// markdown tables, a CSV and a gnuplot script. Torch-free, so its unit test builds fast.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "dcp/attention_bench.h"

namespace dcp {

/// Least-squares slope of log(y) against log(x): the exponent b of y ~ x^b. Throws std::invalid_argument for
/// fewer than 2 points, sizes that differ, a value <= 0, or all x equal.
double loglog_slope(const std::vector<double>& x, const std::vector<double>& y);

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
  int64_t slope_points = 0, slope_from = 0, slope_to = 0;  ///< how many lengths the fit used, their range
  std::optional<AttentionCrossover> crossover;  ///< flexformer variants, when a softmax point was measured
  int64_t longest = 0;            ///< longest measured length (0 when none)
  double longest_seconds = 0;     ///< its median seconds
  double longest_peak_bytes = 0;  ///< its peak bytes
};

/// Summarises `points` (as bench_attention returns them) per variant, in the order the variants first appear.
std::vector<AttentionVariantSummary> summarize_attention_bench(const std::vector<AttentionBenchPoint>& points,
                                                               int64_t slope_min_length = 4096);

/// Time of `p` divided by softmax's at the same length; absent unless both were measured.
std::optional<double> time_ratio_to_softmax(const std::vector<AttentionBenchPoint>& points,
                                            const AttentionBenchPoint& p);

/// Markdown: a summary table (one row per variant: slope, crossover, longest length, its time and peak, skipped
/// points), a time table and a peak-memory table (rows lengths, columns variants; times with their ratio to
/// softmax; skipped points as "skipped: <reason>").
std::string attention_bench_markdown_tables(const std::vector<AttentionBenchPoint>& points,
                                            const std::vector<AttentionVariantSummary>& summaries);

/// One line per point with a header: variant, length, status (measured|skipped), seconds, runs, peak_bytes,
/// predicted_bytes, time_ratio_to_softmax, skip_reason (quoted); numbers of skipped points are empty fields.
std::string attention_bench_csv(const std::vector<AttentionBenchPoint>& points);

/// A gnuplot script that reads `csv_path` (as attention_bench_csv writes it) and draws `png_path`: log-log
/// milliseconds against length and log-log peak MB against length (plus softmax's predicted bytes), one line
/// per variant in `variants`.
std::string attention_bench_gnuplot_script(const std::string& csv_path, const std::string& png_path,
                                           const std::vector<std::string>& variants);

}  // namespace dcp
