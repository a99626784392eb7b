// The check of `dcp profile` under `dcp launch`: real sequence-parallel micro-batches of the model, and the one
// term of the cost model fitted to them (CommFit::overhead_s_per_byte).
#pragma once

#include <cstdint>
#include <vector>

#include "dcp/config.h"
#include "dcp/cost_model.h"
#include "dcp/dist.h"
#include "dcp/model.h"
#include "profile/profiler.h"

namespace dcp {

/// For each of `lengths` x recompute {0, n_layers}: a micro-batch of max(1, min_tokens / length) samples of that
/// many random bytes (the same on every rank), this rank's shard of it (make_shard) with SequenceParallelAttention
/// on `group`,
/// as compute_step_gradients runs it, timed by time_backward (barrier of `group` before every run; `repeats` timed
/// runs, the warm-up alone for points whose warm-up exceeds long_point_s); measured_s is the mean over the ranks
/// of `world` and measured_peak_bytes the max (over_ranks; every rank calls this at once). Alternate points are
/// held out (length i, recompute j: (i + j) odd). Predictions are left 0 (fit_sp_overhead sets them). Throws
/// std::invalid_argument when a length is not a positive multiple of the group size or exceeds
/// data.max_seq_len, and what the model, the attention and the collectives throw.
std::vector<ValidationPoint> validate_sequence_parallel(Transformer& model, const Communicator& world,
                                                        const Communicator& group, const Config& cfg,
                                                        const std::vector<int64_t>& lengths, int64_t min_tokens,
                                                        int64_t repeats, double long_point_s);

/// Fits, for the SP size of `sp`, overhead_s_per_byte >= 0 to the points not held out:
///   measured_s - seconds without the overhead = overhead_s_per_byte * all_to_all_bytes(tokens, sp, r)
/// (tokens: the micro-batch's)
/// (CostModel; relative residuals, fit_nonnegative_least_squares), stores it in sp.fit and
/// device.all_to_all[sp.sp_size] (which must hold the call fit), then sets every point's predicted_s with it and
/// predicted_peak_bytes from `memory`, and sp's validation errors. Throws std::invalid_argument when `points` is
/// empty or device has no all-to-all fit for the size, and what CostModel throws.
void fit_sp_overhead(SpProfile& sp, std::vector<ValidationPoint>& points, const ModelShape& shape,
                     DeviceSpec& device, const MemoryModel& memory);

/// The per-local-token bytes an SP micro-batch holds beyond its share of the sp-1 fit (MemoryCoefficients::
/// sp_token_bytes, Ulysses' stacked q, k, v and send buffers): the largest over the points holding at least
/// half the local tokens of the largest point of
///   (measured_peak_bytes - bytes of `coefficients` with sp_token_bytes 0) / (tokens / sp), and 0 at least.
/// The budget binds at the largest micro-batches, which the fitted model then never under-predicts; small ones
/// carry about a megabyte of allocator slack that does not grow with tokens, and letting them set the value
/// (as the plain maximum did: 1761 B against 621-773 B per local token at 8K-16K tokens on the main job's
/// model) over-predicted every large SP peak by 5-16%. Then sets every point's predicted_peak_bytes with it.
/// Returns the bytes per local token. Throws std::invalid_argument when `points` is empty or holds an sp 1
/// point.
double fit_sp_token_bytes(std::vector<ValidationPoint>& points, const ModelShape& shape,
                          MemoryCoefficients coefficients);

}  // namespace dcp
