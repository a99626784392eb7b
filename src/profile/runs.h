// How `dcp profile` measures one micro-batch shape: inputs of random bytes, a warm-up, then timed
// forward+backward runs that every rank runs as many times.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "dcp/config.h"
#include "dcp/data.h"
#include "dcp/dist.h"
#include "dcp/model.h"

namespace dcp {

/// A corpus whose samples 0, 1, ... have exactly `lengths` tokens (each <= data.max_seq_len): one document of
/// random printable ASCII per length, so that the corpus keeps every one (no NUL, valid UTF-8).
Corpus random_corpus(const std::vector<int64_t>& lengths, const DataConfig& data, std::mt19937_64& rng);

/// What time_backward measured on this rank.
struct Timing {
  double median_s = 0;    ///< median seconds of the timed runs
  double peak_bytes = 0;  ///< largest MemoryMeter::peak_bytes() of the timed runs, bytes
};

/// Times loss().backward() of `model`: a warm-up, then `repeats` timed runs; when the warm-up took longer than
/// `long_point_s` on some rank of `world` (agreed with over_ranks, so all ranks run as many and collectives
/// inside loss() stay matched), the warm-up alone is the measurement. Before every run the gradients are zeroed in place (they stay
/// allocated, as after a trainer's micro-batch), `sync` (the ranks that run the micro-batch together) passes a
/// barrier, and MemoryMeter::reset_peak() starts the peak window. Throws what loss(), backward and the
/// collectives throw.
Timing time_backward(Transformer& model, const std::function<torch::Tensor()>& loss, const Communicator& world,
                     const Communicator& sync, int64_t repeats, double long_point_s);

}  // namespace dcp
