// `dcp bench-sp-attention`: forward and backward seconds of one layer's sequence-parallel attention (Ulysses,
// ring, ulysses-ring) on one causal sequence split over the ranks of a group, with the time of the mode's
// transfers alone and the one-rank time of the whole sequence as the ideal; run under `dcp launch`.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dcp/attention_kernels.h"
#include "dcp/dist.h"
#include "dcp/plan.h"

namespace dcp {

struct SpAttentionBenchOptions {
  std::vector<int64_t> lengths;  ///< tokens of the whole sequence, ascending
  std::vector<std::string> modes{"ulysses", "ring"};  ///< sp_mode names; ulysses-ring uses `ulysses_size`
  int64_t ulysses_size = 0;      ///< for ulysses-ring: ranks per subgroup (0 = the largest that fits)
  std::string dtype = "bf16";    ///< of q, k, v and the output gradient: fp32 or bf16
  int64_t heads = 4;
  int64_t head_dim = 32;
  int64_t repetitions = 2;       ///< timed runs per point after one warm-up; the point's time is their median
  bool one_rank = true;          ///< also time the whole sequence on rank 0 alone (the ideal: that / sp)
  AttentionOptions attention;    ///< tiles of the tiled operator
  uint64_t seed = 1234;
};

/// One (mode, length) point. Every time is the slowest rank's, per run, then the median over runs.
struct SpAttentionBenchPoint {
  std::string mode;           ///< "one rank" or an sp_mode name
  int64_t length = 0;         ///< tokens of the whole sequence
  double forward_seconds = 0;
  double backward_seconds = 0;
  double seconds = 0;         ///< forward + backward
  /// The mode's transfers alone (the same tensors in the same order, no attention between them), fwd + bwd:
  /// what the step would wait for if nothing overlapped. 0 for "one rank".
  double comm_seconds = 0;
  double comm_bytes = 0;      ///< bytes that leave a rank in forward + backward
};

/// Checks `o` for a group of `sp` ranks and returns each mode's group (sp_mode, ulysses_size): throws
/// std::invalid_argument naming the option and the value for sp < 2, an unknown dtype or mode, a length below
/// 2 x sp, a mode that does not fit the heads, or an ulysses-ring without a subgroup size.
std::vector<std::pair<std::string, GroupPlan>> check_sp_attention_bench(const SpAttentionBenchOptions& o, int64_t sp);

/// Runs every point on `world` (all ranks call it; sp = world size; threads as set by the caller). Returns the
/// same points on every rank. Throws what check_sp_attention_bench throws; std::runtime_error when a peer fails.
std::vector<SpAttentionBenchPoint> bench_sp_attention(const SpAttentionBenchOptions& o, const ProcessGroups& groups);

/// The report's tables (markdown): per length, each mode's seconds, its ratio to Ulysses, its efficiency
/// (one-rank seconds / sp / seconds, the metric of ring-flash-attention's table) and its communication share
/// (comm_seconds / seconds).
std::string sp_attention_bench_tables(const std::vector<SpAttentionBenchPoint>& points, int64_t sp);

/// The points as CSV (a header line, then one line per point).
std::string sp_attention_bench_csv(const std::vector<SpAttentionBenchPoint>& points);

/// The markdown report of a bench-sp-attention run on `sp` ranks of `threads` threads each: the command, date,
/// machine and load, the setup and method, then sp_attention_bench_tables; `note` is appended to the machine line.
std::string sp_attention_bench_markdown(const SpAttentionBenchOptions& o, const std::vector<SpAttentionBenchPoint>& points,
                                        int64_t sp, int64_t threads, const std::string& date, double load_start,
                                        double load_end, double wall_s, const std::string& note);

}  // namespace dcp
