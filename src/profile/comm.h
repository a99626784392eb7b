// The SP part of `dcp profile`: the Ulysses all-to-alls timed on the real group and fitted per SP size.
#pragma once

#include <ATen/core/Tensor.h>

#include "dcp/dist.h"
#include "profile/profiler.h"

namespace dcp {

/// Times Communicator::all_to_all on `group` (this rank's aligned group of `sp_size`; every rank of `world`
/// calls this at once, so groups of the same size run concurrently) for each of `local_tokens` x width {3, 1}
/// (the stacked q, k, v and the output of SequenceParallelAttention) with tensors [sp, tokens, width,
/// hidden / sp] of `dtype`: three warm-up calls, then `repeats` calls, each after a barrier of the group; a point's
/// time is the median, then the mean over the ranks of `world` (over_ranks). Every 3rd point is held out and the
/// others fitted (fit_all_to_all). Every rank returns the same fit. Throws std::invalid_argument when
/// local_tokens is empty or holds a non-positive count, repeats < 1, or hidden is not divisible by sp_size;
/// what the collectives throw.
SpProfile profile_all_to_all(const Communicator& world, const Communicator& group, const ModelShape& shape,
                               at::ScalarType dtype, const std::vector<int64_t>& local_tokens, int64_t repeats);

/// Times one ring step on `group` (as profile_all_to_all, every rank at once): each member sends a K, V block
/// [2, tokens, d_kv] of `dtype` (d_kv = shape.kv_dim()) to member rank + 1 and receives one from rank - 1
/// (Communicator::exchange, waited), for each of `local_tokens`; bytes_leaving_rank = the whole block, width 2.
/// Same warm-up, barriers, medians, hold-outs and fit. Throws std::invalid_argument for an empty or
/// non-positive local_tokens or repeats < 1; what the exchanges throw.
SpProfile profile_ring_exchange(const Communicator& world, const Communicator& group, const ModelShape& shape,
                                at::ScalarType dtype, const std::vector<int64_t>& local_tokens, int64_t repeats);

/// Fits sp.fit's latency_s (seconds) and bytes_per_s to sp.points (their measured_s and bytes_leaving_rank; held
/// out points left out),
///   seconds = latency_s + bytes_leaving_rank / bytes_per_s,
/// with fit_nonnegative_least_squares on relative residuals, then sets every point's predicted_s and sp's
/// errors. When that fit finds no cost per byte (noisy times that do not grow with the bytes), it falls back
/// to a latency-only fit, sets bandwidth_fitted false and logs a warning naming the SP size and every measured
/// point: bytes_per_s is then the fastest rate a fitted call reached, max(bytes_leaving_rank / measured_s), and
/// latency_s alone is fitted to measured_s - bytes_leaving_rank / bytes_per_s (relative residuals, >= 0). That
/// rate is one the calls showed: its bytes term never exceeds a measured time, whereas no bytes term at all
/// would make calls beyond the measured sizes free (and SP look cheaper than it is). Throws
/// std::invalid_argument when no point is fitted or a fitted point's measured_s or bytes_leaving_rank is not
/// positive and finite.
void fit_all_to_all(SpProfile& sp);

}  // namespace dcp
