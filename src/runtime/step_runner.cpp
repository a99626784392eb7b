#include "dcp/step_runner.h"

#include <fmt/format.h>

#include <chrono>

#include "dcp/memory_meter.h"
#include "dcp/runtime.h"
#include "dcp/sequence_parallel.h"
#include "util/clock.h"

namespace dcp {
namespace {

// On every rank before any work, so that all ranks fail alike rather than some waiting for the others.
void check_ring_backend(Transformer& model, const StepPlan& plan) {
  const auto& backend = *model->blocks[0]->as<Block>()->attention;
  if (dynamic_cast<const SoftmaxAttention*>(&backend) != nullptr) return;
  for (const auto& g : plan.groups) {
    if (g.sp_size > 1 && g.sp_mode != SpMode::kUlysses) {
      throw std::invalid_argument(fmt::format(
          "step plan (epoch {}, index {}): the group at rank {}{} uses sp_mode {}, which needs attention.backend "
          "softmax (a ring merges partial softmax results by their logsumexps)",
          plan.epoch, plan.index, g.first_rank, plan.num_rounds() > 1 ? fmt::format(" in round {}", g.round) : "",
          sp_mode_name(g.sp_mode)));
    }
  }
}

}  // namespace

StepStats compute_step_gradients(Transformer& model, const Corpus& corpus, const StepPlan& plan,
                                 const ProcessGroups& groups) {
  const Communicator& world = groups.world();
  check_same_plan(plan, world);
  std::vector<int64_t> lengths;
  lengths.reserve(corpus.samples().size());
  for (const auto& s : corpus.samples()) lengths.push_back(s.length);
  const auto work = rank_micro_batches(plan, lengths, groups, model->cfg.kv_heads());
  check_ring_backend(model, plan);
  auto params = model->parameters();
  for (auto& p : params) p.mutable_grad() = torch::Tensor();

  // The peak window of this step: forward and backward of its micro-batches over all rounds (rank_peak_bytes).
  MemoryMeter::reset_peak();
  auto start = std::chrono::steady_clock::now();
  double loss_sum = 0;
  const double scale = 1.0 / static_cast<double>(plan.global_num_tokens);
  // Rounds run in order (rank_micro_batches lists them so); a round's group attention is made once. No barrier
  // between rounds: a rank enters its next group as soon as it is done, and waits there for its members.
  std::shared_ptr<const AttentionWrapper> sp_attention;
  int64_t attention_round = -1;
  std::vector<double> round_s(static_cast<size_t>(plan.num_rounds()), 0.0);
  auto round_start = start;
  for (const MicroBatchWork& w : work) {
    try {
      if (w.round != attention_round) {
        sp_attention = group_attention(w.layout, groups), attention_round = w.round;
        round_start = std::chrono::steady_clock::now();
      }
      // Each rank of the group reads and computes only its shard of the stream, and the loss of its shard.
      PackedBatch batch = make_shard(corpus, w.sample_ids, w.context.sp_rank, w.layout);
      batch.attention = sp_attention;
      torch::Tensor loss = model->loss_sum(batch, w.context.recompute_layers);
      (loss * scale).backward();
      loss_sum += loss.item<double>();
      round_s[static_cast<size_t>(w.round)] = seconds_since(round_start);
    } catch (const std::exception& e) {
      // A peer that died or hung surfaces here (a collective's timeout or a closed connection): say where.
      throw std::runtime_error(fmt::format("{}: {}", describe_work(plan, w), e.what()));
    }
  }
  const double busy = seconds_since(start);
  try {
    return reduce_step(plan, params, loss_sum, busy, MemoryMeter::peak_bytes(), world, round_s);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("step plan (epoch {}, index {}), the gradient all-reduce over the world: {}",
                                         plan.epoch, plan.index, e.what()));
  }
}

}  // namespace dcp
