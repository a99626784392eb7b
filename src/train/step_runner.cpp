#include <fmt/format.h>

#include <chrono>

#include "dcp/memory_meter.h"
#include "dcp/runtime.h"
#include "dcp/sequence_parallel.h"
#include "dcp/train.h"

namespace dcp {
StepResult compute_step_gradients(Transformer& model, const Corpus& corpus, const StepPlan& plan,
                                  const ProcessGroups& groups) {
  const Communicator& world = groups.world();
  check_same_plan(plan, world);
  if (plan.global_num_tokens <= 0) {
    throw std::invalid_argument(fmt::format("step plan (epoch {}, index {}) has no tokens", plan.epoch, plan.index));
  }
  for (const auto& g : plan.groups) {  // checked on every rank before any work, so all ranks fail alike
    if (model->cfg.n_heads % g.sp_size != 0) {
      throw std::invalid_argument(fmt::format(
          "step plan (epoch {}, index {}): sp_size {} does not divide model.n_heads {} (Ulysses shards heads)",
          plan.epoch, plan.index, g.sp_size, model->cfg.n_heads));
    }
  }
  const GroupPlan& group = plan.group_of(world.rank());
  const Communicator& sp_group = groups.group(group.sp_size);
  std::shared_ptr<const AttentionWrapper> sp_attention;
  if (group.sp_size > 1) sp_attention = std::make_shared<SequenceParallelAttention>(sp_group);
  auto params = model->parameters();
  for (auto& p : params) p.mutable_grad() = torch::Tensor();

  // The peak window of this step: forward and backward of its micro-batches (rank_peak_bytes).
  MemoryMeter::reset_peak();
  auto start = std::chrono::steady_clock::now();
  double loss_sum = 0;
  const double scale = 1.0 / static_cast<double>(plan.global_num_tokens);
  for (const auto& mb : group.micro_batches) {
    // Each rank of the group reads and computes only its shard of the stream, and the loss of its shard.
    PackedBatch batch = make_shard(corpus, mb.sample_ids, sp_group.rank(), group.sp_size);
    batch.attention = sp_attention;
    torch::Tensor loss = model->loss_sum(batch, mb.recompute_layers);
    (loss * scale).backward();
    loss_sum += loss.item<double>();
  }
  double busy = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const int64_t peak = MemoryMeter::peak_bytes();

  // One reduction per step: all gradients, then the loss, each rank's busy time in its own slot and its peak
  // bytes in two slots. float32 holds integers below 2^24 exactly, so the peak travels as (peak / 2^24,
  // peak mod 2^24); the other ranks add zeros there, which keeps both parts exact up to 2^48 bytes.
  const int64_t world_size = world.size();
  constexpr int64_t kSplit = int64_t{1} << 24;
  std::vector<torch::Tensor> parts;
  parts.reserve(params.size() + 1);
  for (auto& p : params) {
    parts.push_back(p.grad().defined() ? p.grad().reshape(-1) : torch::zeros({p.numel()}, p.options()));
  }
  auto extra = torch::zeros({1 + 3 * world_size}, torch::kFloat32);
  extra[0] = loss_sum;
  extra[1 + world.rank()] = busy;
  extra[1 + world_size + 2 * world.rank()] = static_cast<double>(peak / kSplit);
  extra[2 + world_size + 2 * world.rank()] = static_cast<double>(peak % kSplit);
  parts.push_back(extra);
  torch::Tensor flat = torch::cat(parts);
  world.allreduce_sum(flat);

  int64_t offset = 0;
  for (auto& p : params) {
    p.mutable_grad() = flat.slice(0, offset, offset + p.numel()).view(p.sizes()).clone();
    offset += p.numel();
  }
  StepResult r;
  r.loss = flat[offset].item<double>() * scale;
  r.tokens = plan.global_num_tokens;
  r.samples = static_cast<int64_t>(plan.sample_ids().size());
  auto slots = flat.slice(0, offset).to(torch::kFloat64);
  const double* v = slots.data_ptr<double>();
  for (int64_t i = 0; i < world_size; ++i) {
    r.rank_busy_s.push_back(v[1 + i]);
    r.rank_peak_bytes.push_back(static_cast<int64_t>(v[1 + world_size + 2 * i]) * kSplit +
                                static_cast<int64_t>(v[2 + world_size + 2 * i]));
  }
  return r;
}

}  // namespace dcp
