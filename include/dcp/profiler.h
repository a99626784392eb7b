// `dcp profile`: measures forward+backward seconds and peak bytes of the real model on this process's device
// (the CPU) over a grid of micro-batch shapes and fits the time model of CostModel and a MemoryModel to them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dcp/config.h"
#include "dcp/cost_model.h"

namespace dcp {

/// What profile_model measures.
struct ProfileOptions {
  int64_t repeats = 3;  ///< timed runs per grid point after one warm-up; the point's time is their median
  /// Sample lengths of the grid, tokens; those above data.max_seq_len are dropped.
  std::vector<int64_t> sample_lengths = {64, 128, 256, 512, 1024};
  /// Token targets of a micro-batch: it holds max(1, tokens / length) samples of one length.
  std::vector<int64_t> micro_batch_tokens = {1024, 4096};
};

/// One measured micro-batch shape.
struct ProfilePoint {
  std::vector<int64_t> lengths;  ///< sample lengths, tokens (all equal within a point)
  int64_t tokens = 0;            ///< sum of lengths
  int64_t recompute_layers = 0;
  FlopCount flops;               ///< CostModel::flops of the point
  double measured_s = 0;         ///< median forward+backward seconds
  double predicted_s = 0;        ///< CostModel::seconds with the fitted device, sp_size 1
  double measured_peak_bytes = 0;   ///< largest MemoryMeter::peak_bytes of the timed runs, bytes
  double predicted_peak_bytes = 0;  ///< MemoryModel::bytes(lengths, 1, recompute_layers) of the fitted model
  bool held_out = false;         ///< left out of the fit; its error is the reported fit error
};

/// Result of profile_model: the fitted device and the grid it was fitted to.
struct ProfileResult {
  /// model_shape_of(cfg, activation_bytes(p)) for p = train.precision resolved on this CPU: SwiGLU, byte
  /// vocabulary, bytes_per_element 4 (measured in fp32) or 2 (bf16)
  ModelShape shape;
  /// name "cpu-profile"; peak_flops = fitted linear FLOP/s with mfu 1; attention_mfu = attention FLOP/s / linear
  /// FLOP/s; micro_batch_overhead_s = fitted fixed seconds; memory_bytes = physical RAM; gpus_per_node 1;
  /// bandwidths and collective latency keep the DeviceSpec defaults (sequence parallelism is not profiled).
  DeviceSpec device;
  std::vector<ProfilePoint> points;
  double fixed_s = 0;                ///< fitted seconds per micro-batch independent of its samples
  double linear_flops_per_s = 0;     ///< fitted rate of the linear FLOPs
  double attention_flops_per_s = 0;  ///< fitted rate of the attention FLOPs
  /// False when the three-term fit gave the attention FLOPs no cost (the grid could not separate them from the
  /// linear ones): then one rate was fitted to all FLOPs and attention_flops_per_s = linear_flops_per_s.
  bool attention_separated = true;
  double heldout_median_error = 0;   ///< median |predicted - measured| / measured over held-out points
  double heldout_max_error = 0;      ///< max of the same
  double fit_median_error = 0;       ///< median relative error over the points the fit used
  /// The fitted MemoryModel's coefficients (bytes; token_bytes is 0, see MemoryModel). Build the model with
  /// MemoryModel(shape, memory, budget_bytes).
  MemoryCoefficients memory;
  double memory_heldout_median_error = 0;  ///< median |predicted - measured| / measured peak bytes, held out
  double memory_heldout_max_error = 0;     ///< max of the same
  double memory_fit_median_error = 0;      ///< median relative error over the points the fit used
  std::string memory_method;               ///< MemoryMeter::method(): counting-allocator or the fallback
  int64_t threads = 0;               ///< intra-op threads used
  int64_t repeats = 0;
  double max_rss_bytes = 0;          ///< process high-water mark (getrusage ru_maxrss) after the run
};

/// Least squares with non-negative coefficients: the x >= 0 minimising sum_i (rows[i] . x - targets[i])^2.
/// Exact for the few columns of a profile fit: every subset of columns is solved by its normal equations
/// (columns scaled to unit norm, Gaussian elimination with partial pivoting) and the feasible solution with the
/// smallest residual wins; columns outside that subset get 0. Throws std::invalid_argument when rows is empty,
/// the rows differ in width or do not match targets, or there are more than 8 columns.
std::vector<double> fit_nonnegative_least_squares(const std::vector<std::vector<double>>& rows,
                                                  const std::vector<double>& targets);

/// Builds the model of `cfg` in train.precision (resolve_precision; one process, torch::manual_seed(run.seed),
/// train.threads intra-op threads or all cores), and times loss_sum(batch, r).backward() on packed
/// micro-batches of random printable bytes (built with Corpus::from_documents) over sample lengths x micro-batch tokens x recompute_layers {0, n_layers}: one
/// warm-up, then the median of `repeats` runs. Within a length the (tokens, recompute) combinations are visited
/// in an order rotated by the length's index, and every 4th point of the grid is held out, so held-out points
/// cover every combination. Fits
///   seconds = fixed + linear_flops / linear_rate + attention_flops / attention_rate
/// (FLOPs from CostModel::flops of the result's shape) with fit_nonnegative_least_squares on relative
/// residuals (each row divided by its measured seconds), so that the fit minimises relative error. When the
/// attention coefficient comes out 0, it refits seconds = fixed + (linear + attention flops) / rate and sets
/// attention_separated false (attention_mfu 1).
/// Memory: before the grid every parameter gets a gradient and two fp32 tensors of its size (AdamW's moments,
/// which the trainer holds), so the measured peaks include the trainer's resident state; gradients are zeroed in
/// place between runs. MemoryMeter::reset_peak() precedes every run and a point's peak is the largest over its
/// timed runs. Fits, on the same points and held-out split,
///   bytes = base + t * (a (L - r) + b r) + Q * (q (L - r) + q0),  t = tokens, Q = sum of squared lengths
/// (MemoryCoefficients; the Q terms are per-sample [heads, s, s] tensors, fitted only for operators that keep
/// them: `attention.impl: reference` softmax and the quadratic flexformer form; 0 for the tiled softmax and the
/// chunked forms) with fit_nonnegative_least_squares on relative residuals. The grid runs sp 1 only: MemoryModel's division by sp
/// is assumed, not measured, and sp_token_bytes is set to 6 * hidden * bytes_per_element (MemoryCoefficients).
/// Throws std::invalid_argument when repeats < 1 or no grid length fits data.max_seq_len, and std::runtime_error
/// when even the one-rate fit gives FLOPs no cost (times that do not grow with FLOPs: too much noise) or the
/// memory fit gives tokens no cost (peaks that do not grow with the micro-batch).
ProfileResult profile_model(const Config& cfg, const ProfileOptions& options = {});

/// Writes `result` as JSON to `path`: "device" (the DeviceSpec fields, read back by DeviceSpec::from_profile),
/// "model" (the ModelShape, its "precision" (precision_of_bytes of bytes_per_element: "fp32" or "bf16"), its
/// attention kind "softmax", "softmax-reference" or "linear" and the linear operator's feature_dim,
/// feature_projections and chunk_size included), "fit" (coefficients, attention_separated and relative errors),
/// "memory" (the
/// MemoryCoefficients, read back with "model" by MemoryModel::from_profile, the meter's method and relative
/// errors), "grid" (per point: sample_length, samples, tokens, recompute_layers, linear_flops, attention_flops,
/// measured_s, predicted_s, measured_peak_bytes, predicted_peak_bytes, held_out), "threads",
/// "repeats", "max_rss_bytes" and "notes" (what is not profiled). Throws std::runtime_error naming the path
/// when it cannot be written.
void write_profile(const ProfileResult& result, const std::string& path);

}  // namespace dcp
