#include "profile/runs.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "dcp/memory_meter.h"
#include "profile/over_ranks.h"
#include "util/clock.h"
#include "util/stats.h"

namespace dcp {

Corpus random_corpus(const std::vector<int64_t>& lengths, const DataConfig& data, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> byte(32, 126);
  std::vector<std::pair<std::string, std::string>> docs;
  for (size_t i = 0; i < lengths.size(); ++i) {
    std::string text(static_cast<size_t>(lengths[i]), ' ');
    for (char& c : text) c = static_cast<char>(byte(rng));
    docs.emplace_back(fmt::format("profile{}", i), std::move(text));
  }
  return Corpus::from_documents(docs, data);
}

Timing time_backward(Transformer& model, const std::function<torch::Tensor()>& loss, const Communicator& world,
                     const Communicator& sync, int64_t repeats, double long_point_s) {
  auto run = [&] {
    model->zero_grad();  // set_to_none false: the gradients stay allocated
    sync.barrier();
    MemoryMeter::reset_peak();
    const auto start = std::chrono::steady_clock::now();
    loss().backward();
    return seconds_since(start);
  };
  Timing t;
  const double warm_up = run();
  // Measured on the default model: a long point's warm-up lies within the spread of its later runs (about
  // +-10% on the 2-vCPU VM), so the extra runs would cost seconds each and buy little (docs/sequence_parallel.md).
  if (over_ranks(world, {warm_up}).max[0] > long_point_s) {
    t.median_s = warm_up;
    t.peak_bytes = static_cast<double>(MemoryMeter::peak_bytes());
    return t;
  }
  std::vector<double> times;
  for (int64_t i = 0; i < repeats; ++i) {
    times.push_back(run());
    t.peak_bytes = std::max(t.peak_bytes, static_cast<double>(MemoryMeter::peak_bytes()));
  }
  t.median_s = median(times);
  return t;
}

}  // namespace dcp
