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
  std::optional<double> model_step_s;      ///< the cost model's uncalibrated prediction (metrics `model_step_s`)
  std::string sp_sizes;                    ///< the step's distinct group SP sizes, ascending, "+"-joined ("1+2")
  int64_t rounds = 1;                      ///< the plan's rounds (metrics `rounds`; absent before rounds: 1)
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
  /// tokens / sum of model_step_s over the measured steps: the throughput the cost model predicts before any
  /// calibration (absent when a measured step has no model_step_s)
  std::optional<double> model_tokens_per_s;
  /// tokens_per_s / the fastest static planner's (static, bucket, packed); absent without a static run
  std::optional<double> speedup_vs_best_static;
};

/// True for the planners that fix one SP size and recompute for the whole run: static, bucket, packed.
bool is_static_planner(const std::string& planner);

/// Summarises one run. Throws std::runtime_error when no step is left to measure.
BenchRow summarize_bench_run(const BenchRun& run, const std::set<int64_t>& warmup_steps);

/// One row per run, fastest (tokens/s) first, with speedup_vs_best_static filled in when a static run is present.
std::vector<BenchRow> summarize_bench(const std::vector<BenchRun>& runs, const std::set<int64_t>& warmup_steps);

/// Tokens/s of every planner in one repetition (time slice) of the bench: slice r holds steps
/// r * slice_steps + 1 .. (r + 1) * slice_steps, warm-up steps excluded. Planners in the order of `runs`.
struct BenchRepetition {
  int64_t index = 0;  ///< 1-based
  std::vector<std::pair<std::string, double>> tokens_per_s;
  std::string fastest;                          ///< the planner with the most tokens/s
  std::optional<double> dcp_opt_over_best_static;  ///< dcp-opt's tokens/s over the fastest static planner's
  std::optional<double> dcp_opt_over_one_round;    ///< dcp-opt's tokens/s over dcp-opt@1's (train.max_rounds 1)
};

/// One BenchRepetition per slice. Throws std::invalid_argument when slice_steps < 1, std::runtime_error naming
/// the planner and slice when a slice has no measured step.
std::vector<BenchRepetition> summarize_repetitions(const std::vector<BenchRun>& runs,
                                                   const std::set<int64_t>& warmup_steps, int64_t slice_steps);

/// The repetitions as a markdown table: tokens/s per planner, the fastest planner, dcp-opt's tokens/s over
/// the fastest static planner's when both ran, and over dcp-opt@1's (one partition per step) when both ran.
std::string bench_repetition_table(const std::vector<BenchRepetition>& reps);

/// Per step composition of SP sizes (BenchStep::sp_sizes), over every run's measured steps with a model_step_s:
/// the number of steps and the median |model_step_s / step_time_s - 1| (the uncalibrated cost model's error).
struct SpPredictionError {
  std::string sp_sizes;
  int64_t steps = 0;
  double median_error = 0;
};
std::vector<SpPredictionError> model_error_by_sp_sizes(const std::vector<BenchRun>& runs,
                                                       const std::set<int64_t>& warmup_steps);

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
