#include "profile/round_switch.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <random>

#include "dcp/sequence_parallel.h"
#include "profile/over_ranks.h"
#include "profile/runs.h"
#include "util/clock.h"
#include "util/stats.h"

namespace dcp {

RoundSwitchProfile profile_round_switch(Transformer& model, const Communicator& world, const Communicator& group,
                                        const Config& cfg, int64_t local_tokens, int64_t repeats) {
  const int64_t sp = group.size();
  if (local_tokens < 1 || repeats < 1 || sp < 2 || local_tokens * sp > cfg.data.max_seq_len) {
    throw std::invalid_argument(fmt::format(
        "round-switch profile: needs local_tokens >= 1 (got {}), repeats >= 1 (got {}), a group of 2 ranks or "
        "more (got {}) and local_tokens x sp_size within data.max_seq_len {}",
        local_tokens, repeats, sp, cfg.data.max_seq_len));
  }
  // Seeded alike on every rank: the shards of round 1's micro-batch are of one sample.
  std::mt19937_64 rng(static_cast<uint64_t>(cfg.run.seed) + 0x5eed);
  const Corpus first_corpus = random_corpus({local_tokens}, cfg.data, rng);
  const Corpus second_corpus = random_corpus({local_tokens * sp}, cfg.data, rng);
  const PackedBatch first_batch = make_batch(first_corpus, {0});
  PackedBatch second_batch = make_shard(second_corpus, {0}, group.rank(), sp);
  second_batch.attention = std::make_shared<SequenceParallelAttention>(group);
  const std::function<void()> first = [&] { model->loss_sum(first_batch, 0).backward(); };
  const std::function<void()> second = [&] { model->loss_sum(second_batch, 0).backward(); };
  const std::function<void()> both = [&] {
    first();
    second();
  };
  const std::function<void()> nothing = [] {};
  const std::function<void()>* runs[] = {&first, &second, &both, &nothing};
  auto timed = [&](const std::function<void()>& fn) {
    model->zero_grad();
    world.barrier();
    const auto start = std::chrono::steady_clock::now();
    fn();
    world.barrier();
    return seconds_since(start);
  };
  for (const auto* fn : runs) timed(*fn);
  std::vector<std::vector<double>> times(4);
  for (int64_t i = 0; i < repeats; ++i) {
    for (size_t k = 0; k < 4; ++k) times[k].push_back(timed(*runs[k]));
  }
  std::vector<double> medians;
  for (const auto& t : times) medians.push_back(median(t));
  const std::vector<double> mean = over_ranks(world, medians).mean;
  RoundSwitchProfile out;
  out.sp_size = sp;
  out.local_tokens = local_tokens;
  out.repeats = repeats;
  out.first_s = mean[0], out.second_s = mean[1], out.both_s = mean[2], out.barrier_s = mean[3];
  out.raw_s = out.both_s - out.first_s - out.second_s + out.barrier_s;
  out.switch_s = std::max(0.0, out.raw_s);
  return out;
}

}  // namespace dcp
