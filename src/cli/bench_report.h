// `dcp bench` results: what each planner's run measured (metrics.jsonl, summary.json) summarised into one row per
// planner, written as a markdown table, a CSV and a gnuplot script. Torch-free, so its unit test builds fast.
#pragma once

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace dcp {

/// One line of metrics.jsonl, the fields the bench uses.
struct BenchStep {
  int64_t step = 0;
  int64_t tokens = 0;
  double step_time_s = 0;
  double imbalance = 0;
  std::optional<double> predicted_step_s;  ///< null on a run's first step (no calibration yet)
  std::optional<double> peak_bytes;        ///< largest of the step's `rank_peak_bytes`, when the trainer writes them
};

/// One planner's run: its steps and the summary.json fields the bench uses.
struct BenchRun {
  std::string planner;
  std::vector<BenchStep> steps;
  std::optional<double> heldout_bits_per_byte_final;
  std::optional<double> peak_bytes;  ///< summary.json `peak_bytes`, when the trainer writes it
  int64_t threads_per_rank = 0;
  int64_t world_size = 0;
};

/// Reads run_dir/metrics.jsonl and run_dir/summary.json. Throws std::runtime_error naming the file (and line)
/// that is missing or malformed.
BenchRun read_bench_run(const std::string& planner, const std::string& run_dir);

/// One planner's numbers over its measured steps (every step not in `warmup_steps`).
struct BenchRow {
  std::string planner;
  int64_t steps = 0;           ///< steps trained
  int64_t steps_measured = 0;  ///< steps left after dropping the warm-up steps
  int64_t tokens = 0;          ///< tokens of the measured steps
  double tokens_per_s = 0;     ///< tokens / sum of step_time_s over the measured steps
  double mean_imbalance = 0;
  int64_t steps_predicted = 0;           ///< measured steps that have a prediction
  std::optional<double> mean_predicted_s;  ///< over the measured steps with a prediction
  std::optional<double> mean_measured_s;   ///< over the same steps
  std::optional<double> median_prediction_error;  ///< median |predicted / measured - 1| over the same steps
  std::optional<double> peak_bytes;  ///< max of summary `peak_bytes` and every step's `rank_peak_bytes`
  std::optional<double> heldout_bits_per_byte_final;
  std::optional<double> speedup_vs_bucket;  ///< tokens_per_s / bucket's; absent without a bucket run
};

/// Summarises one run. Throws std::runtime_error when no step is left to measure.
BenchRow summarize_bench_run(const BenchRun& run, const std::set<int64_t>& warmup_steps);

/// One row per run, fastest (tokens/s) first, with speedup_vs_bucket filled in when a "bucket" run is present.
std::vector<BenchRow> summarize_bench(const std::vector<BenchRun>& runs, const std::set<int64_t>& warmup_steps);

/// Median of the rows' step-time prediction errors, each step of every row counted once; absent when none.
std::optional<double> overall_median_prediction_error(const std::vector<BenchRun>& runs,
                                                      const std::set<int64_t>& warmup_steps);

/// The markdown table (header, separator, one line per row). Missing numbers print as "n/a".
std::string bench_markdown_table(const std::vector<BenchRow>& rows);

/// The same columns as CSV, with a header line; missing numbers are empty fields.
std::string bench_csv(const std::vector<BenchRow>& rows);

/// `s` as a gnuplot string literal: in double quotes, with double quotes and backslashes escaped.
std::string gnuplot_quoted(const std::string& s);

/// A gnuplot script that reads `csv_path` (as bench_csv writes it) and draws `png_path`: tokens/s per planner,
/// and mean predicted vs measured step seconds per planner.
std::string bench_gnuplot_script(const std::string& csv_path, const std::string& png_path);

}  // namespace dcp
