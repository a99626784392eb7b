// `dcp profile`: measures forward+backward seconds and peak bytes of the real model on this process's device
// (the CPU) over a grid of micro-batch shapes and fits the time model of CostModel and a MemoryModel to them;
// under `dcp launch` also the Ulysses all-to-alls of every SP group, and real SP micro-batches against the fit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dcp/config.h"
#include "dcp/cost_model.h"

namespace dcp {

class ProcessGroups;

/// What profile_model measures. Empty lists and zeros take the defaults described, which follow the config.
struct ProfileOptions {
  /// Timed runs per point after one warm-up (the point's time is their median). A point whose warm-up took
  /// longer than long_point_s on some rank is measured by its warm-up alone: long points vary little from run
  /// to run, and they are what makes the profile take long.
  int64_t repeats = 3;
  double long_point_s = 1.0;  ///< seconds; see repeats
  /// The longest sample of the default lists below, tokens; 0 = data.max_seq_len. Must lie in
  /// [min_profile_max_length(largest SP size profiled), data.max_seq_len].
  int64_t max_length = 0;
  /// Sample lengths of the compute grid, tokens; those above data.max_seq_len are dropped. Empty: max_length,
  /// max_length / 4, / 16, ... down to 128, or max_length, / 2 and / 4 when that gives fewer than three.
  std::vector<int64_t> sample_lengths;
  /// Token targets of a micro-batch: it holds max(1, tokens / length) samples of one length. Empty: {T / 8, T}
  /// with T = max(max_length, train.micro_batch_tokens).
  std::vector<int64_t> micro_batch_tokens;
  /// SP profile (under `dcp launch`): tokens a rank holds in the timed all-to-alls. Empty: 64, 128, ... (doubling)
  /// up to the most of 128, max(T, max_length) / sp and the tokens of a 4 MiB q, k, v call.
  std::vector<int64_t> comm_local_tokens;
  int64_t comm_repeats = 9;  ///< timed calls per all-to-all point after three warm-up calls (median)
  /// Sample lengths of the SP validation micro-batches (recompute 0 and n_layers; each holds as many samples as
  /// the smallest micro_batch_tokens target gives, at least one, so that it is within the grid's sizes); each
  /// must be a multiple of every SP size and at most data.max_seq_len. Empty: max_length / 16, / 8, / 4, / 2 and
  /// / 1, each rounded down to a multiple of the SP size (at least the SP size, at most max_length).
  std::vector<int64_t> validation_lengths;
};

/// One measured micro-batch shape.
struct ProfilePoint {
  std::vector<int64_t> lengths;  ///< sample lengths, tokens (all equal within a point)
  int64_t tokens = 0;            ///< sum of lengths
  int64_t recompute_layers = 0;
  FlopCount flops;               ///< CostModel::flops of the point
  double measured_s = 0;         ///< median forward+backward seconds (mean over the ranks under `dcp launch`)
  double predicted_s = 0;        ///< CostModel::seconds with the fitted device, sp_size 1
  /// largest MemoryMeter::peak_bytes of the timed runs (max over the ranks), bytes
  double measured_peak_bytes = 0;
  double predicted_peak_bytes = 0;  ///< MemoryModel::bytes(lengths, 1, recompute_layers) of the fitted model
  bool held_out = false;         ///< left out of the fit; its error is the reported fit error
};

/// One timed all-to-all shape of the SP profile: Communicator::all_to_all of a rank's local_tokens x width x
/// hidden activations in the run's precision, as SequenceParallelAttention sends them.
struct CommPoint {
  int64_t local_tokens = 0;       ///< tokens a rank holds (the micro-batch's tokens / sp)
  int64_t width = 1;              ///< hidden-sized vectors per token: 3 (q, k, v stacked) or 1 (the output)
  double bytes_leaving_rank = 0;  ///< local_tokens * width * hidden * bytes_per_element * (sp - 1) / sp, bytes
  double measured_s = 0;          ///< median seconds of one call, mean over the ranks of the world
  double predicted_s = 0;         ///< latency_s + bytes_leaving_rank / bytes_per_s of the fit
  bool held_out = false;          ///< left out of the fit (every 3rd point)
};

/// The SP profile of one size, on the aligned groups of that size (all of them at once).
struct SpProfile {
  int64_t sp_size = 0;
  /// latency_s and bytes_per_s: seconds per call = latency_s + bytes_leaving_rank / bytes_per_s fitted to
  /// `points` (fit_all_to_all); overhead_s_per_byte: fitted to the validation points not held out (profile_model).
  CommFit fit;
  /// False when the two-term fit found no cost per byte and bytes_per_s is the fastest measured rate with only
  /// latency_s fitted (fit_all_to_all, train/profile_comm.h).
  bool bandwidth_fitted = true;
  std::vector<CommPoint> points;
  double heldout_median_error = 0;  ///< median |predicted - measured| / measured over held-out calls
  double heldout_max_error = 0;     ///< max of the same
  double fit_median_error = 0;      ///< median relative error over the calls the fit used
  /// The same over this size's validation micro-batches, with the fitted overhead: held out, and fitted.
  double validation_heldout_median_error = 0;
  double validation_heldout_max_error = 0;
  double validation_fit_median_error = 0;
};

/// A real sequence-parallel micro-batch of the model (make_shard + SequenceParallelAttention, as the trainer
/// runs it), timed and predicted.
struct ValidationPoint {
  int64_t sp_size = 0;
  std::vector<int64_t> lengths;  ///< sample lengths, tokens
  int64_t recompute_layers = 0;
  double measured_s = 0;   ///< median forward+backward seconds on a rank, mean over the ranks of the world
  /// CostModel::seconds(lengths, sp_size, recompute_layers) with the fitted device (overhead_s_per_byte included)
  double predicted_s = 0;
  double measured_peak_bytes = 0;   ///< largest MemoryMeter::peak_bytes of the timed runs, max over ranks
  double predicted_peak_bytes = 0;  ///< MemoryModel::bytes(lengths, sp_size, recompute_layers) of the fit
  bool held_out = false;  ///< left out of the overhead fit (alternate points: lengths and recompute both vary)
};

/// The switch between two rounds of a step, measured on real groups (profile_round_switch,
/// profile/round_switch.h): medians of whole runs (barrier, work, barrier), mean over the ranks, seconds.
struct RoundSwitchProfile {
  int64_t sp_size = 0;       ///< the second round's group (the first runs sp 1 on every rank)
  int64_t local_tokens = 0;  ///< tokens a rank holds in each round
  int64_t repeats = 0;
  double first_s = 0;   ///< round 0 alone
  double second_s = 0;  ///< round 1 alone
  double both_s = 0;    ///< round 0, then round 1 (no barrier between)
  double barrier_s = 0; ///< no work: the closing barrier each run holds
  double raw_s = 0;     ///< both_s - first_s - second_s + barrier_s (may be negative: noise)
  double switch_s = 0;  ///< max(0, raw_s): DeviceSpec::round_switch_s
};

/// Result of profile_model: the fitted device and the grid it was fitted to.
struct ProfileResult {
  /// model_shape_of(cfg, activation_bytes(p)) for p = train.precision resolved on this CPU: SwiGLU, byte
  /// vocabulary, bytes_per_element 4 (measured in fp32) or 2 (bf16)
  ModelShape shape;
  /// name "cpu-profile"; peak_flops = fitted linear FLOP/s with mfu 1; attention_mfu = attention FLOP/s / linear
  /// FLOP/s; micro_batch_overhead_s = fitted fixed seconds; memory_bytes = physical RAM; gpus_per_node 1;
  /// all_to_all = the fits of `sequence_parallel`; intra_node_bw, inter_node_bw and collective_latency_s keep
  /// the DeviceSpec defaults (used only by SP sizes without a fit, and by the gradient all-reduce).
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
  /// One per SP size above 1 of the process groups, ascending; empty in one process.
  std::vector<SpProfile> sequence_parallel;
  /// The ring exchanges per SP size above 1, ascending: one ring step (every rank sends a K, V block of
  /// 2 x local_tokens x d_kv elements to the next member and receives one from the previous) timed on the real
  /// group and fitted like the all-to-alls (fit_all_to_all: latency_s + bytes_leaving_rank / bytes_per_s, the
  /// whole block leaving the rank; overhead_s_per_byte 0). Read back into DeviceSpec::ring. Empty in one
  /// process.
  std::vector<SpProfile> ring;
  std::vector<ValidationPoint> validation;  ///< by SP size, then length, then recompute; empty in one process
  /// The round switch on the largest SP size profiled (device.round_switch_s = its switch_s); sp_size 0 in one
  /// process (the device keeps the default).
  RoundSwitchProfile round_switch;
  int64_t world_size = 1;            ///< ranks that measured concurrently
  int64_t threads = 0;               ///< intra-op threads per rank
  int64_t repeats = 0;
  double max_rss_bytes = 0;          ///< process high-water mark (getrusage ru_maxrss) after the run, max over ranks
  double wall_s = 0;                 ///< seconds profile_model took on this rank
};

/// The shortest ProfileOptions::max_length (tokens) the grids can be built from when the largest SP size
/// profiled is `largest_sp_size` (1 in one process): 4, so that the default sample lengths max_length, / 2 and
/// / 4 are three distinct lengths (the time fit needs them to tell attention FLOPs from linear ones), and at
/// least largest_sp_size (the SP validation's sample lengths are multiples of the SP size, at most max_length).
int64_t min_profile_max_length(int64_t largest_sp_size);
/// The same for the SP sizes profile_model profiles under `world_size` ranks: the largest of
/// usable_sp_sizes(parallel.sp_sizes, world_size, model.n_heads), 1 in one process.
int64_t min_profile_max_length(const ParallelConfig& parallel, const ModelConfig& model, int64_t world_size);

/// Least squares with non-negative coefficients: the x >= 0 minimising sum_i (rows[i] . x - targets[i])^2.
/// Exact for the few columns of a profile fit: every subset of columns is solved by its normal equations
/// (columns scaled to unit norm, Gaussian elimination with partial pivoting) and the feasible solution with the
/// smallest residual wins; columns outside that subset get 0. Throws std::invalid_argument when rows is empty,
/// the rows differ in width or do not match targets, or there are more than 8 columns.
std::vector<double> fit_nonnegative_least_squares(const std::vector<std::vector<double>>& rows,
                                                  const std::vector<double>& targets);

/// Builds the model of `cfg` in train.precision (resolve_precision; torch::manual_seed(run.seed) reseeds torch's
/// global generator; intra-op threads = threads_per_rank: train.threads, or the cores / local ranks as the
/// trainer uses), and times loss_sum(batch, r).backward() on packed micro-batches of random printable bytes
/// (built with Corpus::from_documents) over sample lengths x micro-batch tokens x recompute_layers {0, n_layers}
/// (ProfileOptions): one warm-up, then the median of `repeats` runs. Within a length the (tokens, recompute)
/// combinations are visited in an order rotated by the length's index, and every 4th point of the grid is held
/// out, so held-out points cover every combination. Fits
///   seconds = fixed + linear_flops / linear_rate + attention_flops / attention_rate
/// (FLOPs from CostModel::flops of the result's shape) with fit_nonnegative_least_squares on relative
/// residuals (each row divided by its measured seconds), so that the fit minimises relative error. When the
/// attention or the linear coefficient comes out 0, or carries under 0.1% of every point's time (the grid did not
/// separate them), it refits seconds = fixed + (linear + attention flops) / rate and sets attention_separated
/// false (attention_mfu 1).
/// Memory: before the grid every parameter gets a gradient and two fp32 tensors of its size (AdamW's moments,
/// which the trainer holds), so the measured peaks include the trainer's resident state (and every other tensor
/// alive in the process: call it before building a model of your own, or count that model in the budget);
/// gradients are zeroed in place between runs. MemoryMeter::reset_peak() precedes every run and a point's peak
/// is the largest over its timed runs. Fits, on the same points and held-out split,
///   bytes = base + t * (a (L - r) + b r) + Q * (q (L - r) + q0),  t = tokens, Q = sum of squared lengths
/// (MemoryCoefficients; the Q terms are per-sample [heads, s, s] tensors, fitted only for operators that keep
/// them: `attention.impl: reference` softmax and the quadratic flexformer form; 0 for the tiled softmax and the
/// chunked forms) with fit_nonnegative_least_squares on relative residuals. sp_token_bytes is
/// 6 * hidden * bytes_per_element (MemoryCoefficients) in one process; with `groups` it is fitted to the SP
/// micro-batches' peaks (fit_sp_token_bytes, train/profile_validation.h: the largest excess per local token).
///
/// With `groups` (every rank of groups->world() calls this at once, e.g. under `dcp launch`): every rank runs
/// the grid concurrently (a barrier of the world before every run), and each point's time is the mean and its
/// peak the max over the ranks (one allreduce) before the fits, so every rank returns the identical fit. Then
/// for each SP size s > 1 of usable_sp_sizes(parallel.sp_sizes, world size, n_heads) (groups must have them;
/// sizes of parallel.sp_sizes that do not divide n_heads are skipped with a warning naming them): the
/// all-to-alls of SequenceParallelAttention timed on groups->group(s) and fitted (SpProfile,
/// train/profile_comm.h; a fit that finds no cost per byte falls back to a latency-only fit, with a warning)
/// into device.all_to_all[s]; then
/// real SP micro-batches of the model on that group (ValidationPoint; train/profile_validation.h), to which
///   measured - CostModel::seconds without overhead = overhead_s_per_byte * CostModel::all_to_all_bytes
/// is fitted (relative residuals, >= 0) on alternate points, the others held out, and compared with the
/// MemoryModel; then the round switch (profile_round_switch, profile/round_switch.h) from sp-1 micro-batches to
/// the largest SP size, at the smallest validation length per rank, into device.round_switch_s. Without `groups`
/// (nullptr): one process, no SP profile (round_switch_s keeps the DeviceSpec default).
/// Throws std::invalid_argument for bad options (repeats or comm_repeats < 1, long_point_s <= 0, max_length
/// (or data.max_seq_len for 0) outside [min_profile_max_length, data.max_seq_len], no grid length fitting
/// data.max_seq_len, validation lengths that are not multiples of an SP size),
/// and std::runtime_error when even the one-rate fit gives FLOPs no cost (times that do not grow with FLOPs:
/// too much noise), the memory fit gives tokens no cost (peaks that do not grow with the micro-batch), or a peer
/// fails (the collectives' timeouts).
ProfileResult profile_model(const Config& cfg, const ProcessGroups* groups, const ProfileOptions& options = {});

/// profile_model's time fit on result.points (their flops, measured_s and held_out; result.shape for the
/// predictions): sets fixed_s, the two rates (one joint rate and attention_separated false when either comes out
/// 0 or carries under 0.1% of every point's time), the device, every point's predicted_s and the time errors.
/// Throws std::runtime_error when even the joint fit gives FLOPs no cost (or under 0.1% of every point's time).
void fit_profile_time(ProfileResult& result);

/// Writes `result` as JSON to `path`: "device" (the DeviceSpec fields, read back by DeviceSpec::from_profile),
/// "model" (the ModelShape, its "precision" (precision_of_bytes of bytes_per_element: "fp32" or "bf16"), its
/// attention kind "softmax", "softmax-reference" or "linear" and the linear operator's feature_dim,
/// feature_projections and chunk_size included), "fit" (coefficients, attention_separated and relative errors),
/// "memory" (the MemoryCoefficients, read back with "model" by MemoryModel::from_profile, the meter's method and
/// relative errors), "grid" (per point: sample_length, samples, tokens, recompute_layers, linear_flops,
/// attention_flops, measured_s, predicted_s, measured_peak_bytes, predicted_peak_bytes, held_out), when the
/// result has an SP profile "sequence_parallel" ("formula"; "fits": per SP size sp_size, latency_s,
/// bytes_per_s, overhead_s_per_byte (read back into DeviceSpec::all_to_all), bandwidth_fitted,
/// heldout_median_rel_error, heldout_max_rel_error, fit_median_rel_error, validation_heldout_median_rel_error,
/// validation_heldout_max_rel_error, validation_fit_median_rel_error and its "grid" of local_tokens, width,
/// bytes_leaving_rank, measured_s, predicted_s, held_out; "validation": per point sp_size, sample_length,
/// samples, recompute_layers, measured_s, predicted_s, rel_error, measured_peak_bytes, predicted_peak_bytes,
/// held_out; "ring_fits", when the result has ring fits: per SP size sp_size, latency_s, bytes_per_s (read back
/// into DeviceSpec::ring), bandwidth_fitted, the three relative errors and its "grid" of local_tokens,
/// bytes_leaving_rank (the block), measured_s, predicted_s, held_out), "world_size", "threads", "repeats",
/// "round_switch" (when measured: sp_size, local_tokens, repeats, first_s, second_s, both_s, barrier_s, raw_s,
/// switch_s), "max_rss_bytes", "wall_s" and "notes" (what is assumed rather than measured). Throws std::runtime_error
/// naming the path when it cannot be written.
void write_profile(const ProfileResult& result, const std::string& path);

}  // namespace dcp
