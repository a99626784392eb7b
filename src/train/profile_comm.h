// The SP part of `dcp profile`: the Ulysses all-to-alls timed on the real group and fitted per SP size.
#pragma once

#include <ATen/core/Tensor.h>

#include "dcp/dist.h"
#include "dcp/profiler.h"

namespace dcp {

/// Times Communicator::all_to_all on `group` (this rank's aligned group of `sp_size`; every rank of `world`
/// calls this at once, so groups of the same size run concurrently) for each of `local_tokens` x width {3, 1}
/// (the stacked q, k, v and the output of SequenceParallelAttention) with tensors [sp, tokens, width,
/// hidden / sp] of `dtype`: three warm-up calls, then `repeats` calls, each after a barrier of the group; a point's
/// time is the median, then the mean over the ranks of `world` (over_ranks). Every 3rd point is held out and
///   seconds = latency_s + bytes_leaving_rank / bytes_per_s
/// is fitted to the others with fit_nonnegative_least_squares on relative residuals. Every rank returns the
/// same fit. Throws std::invalid_argument when local_tokens is empty or holds a non-positive count, repeats < 1,
/// or hidden is not divisible by sp_size; std::runtime_error when the fit finds no cost per byte (times that
/// do not grow with the bytes); what the collectives throw.
SpProfile profile_all_to_all(const Communicator& world, const Communicator& group, const ModelShape& shape,
                               at::ScalarType dtype, const std::vector<int64_t>& local_tokens, int64_t repeats);

}  // namespace dcp
