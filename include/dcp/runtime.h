// DCP for a user's own LibTorch model and training loop: plan every global batch, run each micro-batch under
// its sequence-parallel group and recompute setting, finish the step with one gradient reduction.
// docs/integration.md shows the diff against a plain loop (about ten changed lines); examples/byte_gpt.cpp is
// a complete user-style program.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dcp/config.h"
#include "dcp/cost_model.h"
#include "dcp/dist.h"
#include "dcp/plan.h"
#include "dcp/planners.h"
#include "dcp/precision.h"

namespace dcp {

/// How a Runtime plans.
struct RuntimeOptions {
  /// The user's model as the cost and memory models see it; the Runtime sets its bytes_per_element to the
  /// resolved precision's activation_bytes (2 bf16, 4 fp32), so that a profile of another precision is refused.
  ModelShape shape;
  /// auto | bf16 | fp32, as train.precision (resolve_precision). The Runtime only resolves it and plans with it;
  /// the model computes in Runtime::precision() itself (docs/integration.md, "Precision").
  std::string precision = "auto";
  std::string planner = "dcp-opt";   ///< a name of planner_names(); it plans Ulysses groups (dcp::attention)
  std::string cost_model = "h200";   ///< DeviceSpec::named: "h200" or a `dcp profile` JSON file
  MemoryConfig memory;               ///< per-rank budget (memory.budget_bytes, memory.fraction of the device)
  int64_t tokens_per_step = 1 << 20; ///< global batch: a step takes samples of the epoch order up to this many tokens
  uint64_t seed = 1234;              ///< epoch order (identical on every rank)
  std::string sp_sizes = "pow2";     ///< process groups created at start-up (resolve_sp_sizes)
  double timeout_s = 60;             ///< rendezvous and every collective, seconds
};

/// Where the current micro-batch runs; read by dcp::attention and dcp::layer inside the model.
struct MicroBatchContext {
  const Communicator* sp_group = nullptr;  ///< the micro-batch's SP group; null = no sequence parallelism
  int64_t sp_size = 1;
  int64_t sp_rank = 0;
  int64_t recompute_layers = 0;  ///< layers with index < this recompute their activations in backward
  /// How the group splits attention; dcp::attention serves Ulysses only (ring modes run in dcp's trainer, whose
  /// softmax attention they need, so a Runtime plans with Ulysses unless told otherwise)
  SpMode sp_mode = SpMode::kUlysses;
};

/// This rank's tokens of a packed micro-batch: the samples' streams are concatenated in order and padded to a
/// multiple of SpLayout::pad_multiple(); the rank holds the pieces of that stream SpLayout::shard names (one
/// contiguous piece under Ulysses).
struct ShardRange {
  /// [begin, end) pieces of the stream, tokens, in the order of this rank's local tokens; they add up to the
  /// padded total / sp_size
  std::vector<std::pair<int64_t, int64_t>> pieces;
  std::vector<int64_t> cu_seqlens;  ///< cumulative lengths of the whole padded stream; the padding, if any, is
                                    ///< a segment of its own so nothing attends across it
  int64_t num_tokens() const;       ///< tokens this rank holds
};

/// Throws std::invalid_argument for empty or non-positive lengths or sp_rank outside [0, sp_size).
ShardRange shard_range(const std::vector<int64_t>& lengths, int64_t sp_rank, const SpLayout& layout);

/// One micro-batch of this rank's group in one round of the step.
struct MicroBatchWork {
  std::vector<int64_t> sample_ids;  ///< in stream order
  ShardRange shard;                 ///< the tokens this rank computes
  MicroBatchContext context;        ///< install with MicroBatchScope while running the model on it
  int64_t round = 0;                ///< the plan's round (GroupPlan::round) this micro-batch runs in
  int64_t group_first_rank = 0;     ///< the first rank of its group in that round
  SpLayout layout;                  ///< its group's layout (GroupPlan::layout())
  int64_t index = 0;                ///< its position among the group's micro-batches
};

/// What one global step measured, identical on every rank after the step's single gradient reduction.
struct StepStats {
  double loss = 0;                  ///< mean token loss of the step over its global_num_tokens (nats)
  int64_t tokens = 0;               ///< plan.global_num_tokens
  int64_t samples = 0;              ///< samples in the step, all groups
  std::vector<double> rank_busy_s;  ///< per rank: forward+backward seconds before the reduction
  /// Per rank: peak bytes during the forward+backward of its micro-batches (MemoryMeter, dcp/memory_meter.h:
  /// tensor storage with the counting allocator, else the process high-water mark). Carried exactly.
  std::vector<int64_t> rank_peak_bytes;
  /// Per rank, per round of the plan: seconds from the rank's start of the round (its first micro-batch, or the
  /// end of its previous round) to the end of its last micro-batch in it, waits for its group's members
  /// included. Empty when the step's runner did not time its rounds (Runtime::finish_step).
  std::vector<std::vector<double>> rank_round_s;
};

/// Installs a micro-batch's context for the current thread until destroyed (restores the previous one).
class MicroBatchScope {
 public:
  explicit MicroBatchScope(const MicroBatchContext& context);
  ~MicroBatchScope();
  MicroBatchScope(const MicroBatchScope&) = delete;
  MicroBatchScope& operator=(const MicroBatchScope&) = delete;

 private:
  MicroBatchContext previous_;
};

/// The context installed on this thread (default: one rank, no recompute).
const MicroBatchContext& current_micro_batch();

/// Attention of the user's model, q, k, v: [T_local, heads, head_dim] (this rank's tokens), cu_seqlens as in
/// ShardRange (the whole stream). Calls fn(q, k, v, cu_seqlens) with the whole stream's tokens: directly when
/// the current micro-batch has no sequence parallelism, else inside Ulysses all-to-alls over the SP group
/// (fn then sees heads / sp_size heads and the whole padded stream; Jacobs et al. 2023, DeepSpeed-Ulysses).
/// Returns [T_local, heads, head_dim]. Throws std::invalid_argument when heads is not divisible by sp_size, and
/// for a micro-batch of a ring mode (fn is an arbitrary function, and a ring needs the logsumexp of softmax).
using AttentionFn = std::function<at::Tensor(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const at::Tensor& cu_seqlens)>;
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
                     const AttentionFn& fn);

/// Layer `index` (0-based) of the user's model: fn(x), recomputed in backward (activation checkpointing) when
/// index < current_micro_batch().recompute_layers. The context is captured, so a recomputation in backward
/// runs under the same SP group. fn must follow dcp::recompute's rules (deterministic, owns what it reads).
at::Tensor layer(int64_t index, const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& x);

/// Throws std::runtime_error naming the step and the hashes when the ranks hold different plans (all-reduce
/// of the plan hash over `world`).
void check_same_plan(const StepPlan& plan, const Communicator& world);

/// The micro-batches this rank runs in `plan`, in execution order: round 0's micro-batches of the rank's group
/// in that round, then round 1's, ..., with their shards and contexts (each context names the group of its
/// round). `lengths`: tokens of every sample id the plan names. Throws std::invalid_argument when the plan has
/// no tokens, a group's Ulysses part (sp_size under ulysses, ulysses_size under ulysses-ring) does not divide
/// `heads` (naming the group and, in a plan of several rounds, its round), or an id has no length;
/// std::out_of_range when no process group of an sp_size exists or a round has no group for this rank.
std::vector<MicroBatchWork> rank_micro_batches(const StepPlan& plan, const std::vector<int64_t>& lengths,
                                               const ProcessGroups& groups, int64_t heads);

/// The step's single reduction: sums every parameter gradient (undefined ones count as zero), `loss_sum`, and
/// each rank's `busy_s`, `peak_bytes` and `round_s` (seconds per round of the plan, or empty) in its own slots
/// over the world, then writes the summed gradients back into .grad. With every micro-batch's loss divided by
/// plan.global_num_tokens before backward, every rank then holds the gradient of the step's mean token loss,
/// whatever the rounds. Throws std::runtime_error when a peer fails, std::invalid_argument when round_s is
/// neither empty nor one value per round.
StepStats reduce_step(const StepPlan& plan, const std::vector<at::Tensor>& parameters, double loss_sum,
                      double busy_s, int64_t peak_bytes, const Communicator& world,
                      const std::vector<double>& round_s = {});

/// The context of a fault in `work` of `plan`: "step plan (epoch E, index I), round R, the group at rank F
/// (sp_size S, sp_mode M), micro_batch K" (the round only in a plan of several rounds). Errors of the step's
/// micro-batches carry it, so that a peer that died or hung is reported with where the step stood.
std::string describe_work(const StepPlan& plan, const MicroBatchWork& work);

/// DCP for a user's model (about ten lines, docs/integration.md):
///   dcp::Runtime dcp(options);                                  // rendezvous, process groups, cost model
///   auto plans = dcp.plan_epoch(lengths, epoch).steps;         // identical on every rank
///   for (auto& step : plans) {
///     for (auto& mb : dcp.micro_batches(step, lengths)) {
///       dcp::MicroBatchScope scope(mb.context);
///       dcp.backward(my_loss_sum(model, mb), step);             // model calls dcp::attention / dcp::layer
///     }
///     dcp.finish_step(step, model->parameters());
///     optimizer.step();
///   }
class Runtime {
 public:
  /// Reads the launcher's variables (DistEnv::from_environment) and creates the process groups. Throws what
  /// DistEnv, ProcessGroups, DeviceSpec::named and the models throw (memory_model_for: a profile of another
  /// precision or model), std::invalid_argument for an unknown planner, ConfigError for a bad precision.
  explicit Runtime(RuntimeOptions options);
  /// Uses process groups created by the caller (they must outlive the Runtime).
  Runtime(RuntimeOptions options, const ProcessGroups& groups);

  int64_t rank() const { return groups_->env().rank; }
  int64_t world_size() const { return groups_->env().world_size; }
  const ProcessGroups& groups() const { return *groups_; }
  const CostModel& cost() const { return cost_; }
  const MemoryModel& memory() const { return memory_; }
  /// options.precision resolved on this CPU, with the reason (for the user's log).
  const PrecisionChoice& precision() const { return precision_; }

  /// One epoch of samples 0..n-1 with these lengths (tokens) cut into steps of options.tokens_per_step and
  /// planned; a pure function of its inputs, so every rank computes the same plans without communication.
  /// Throws what the planner throws (std::invalid_argument for non-positive lengths).
  PlanSet plan_epoch(const std::vector<int64_t>& lengths, int64_t epoch) const;
  /// Checks that every rank holds the same step (check_same_plan), starts the step's busy clock and peak-memory
  /// window and returns rank_micro_batches.
  std::vector<MicroBatchWork> micro_batches(const StepPlan& step, const std::vector<int64_t>& lengths);
  /// Back-propagates loss_sum (the sum of token losses of this rank's shard) / step.global_num_tokens and
  /// accumulates its value for the step's loss. loss_sum: scalar.
  void backward(const at::Tensor& loss_sum, const StepPlan& step);
  /// reduce_step over the world with the accumulated loss, busy time and peak bytes; resets the loss.
  StepStats finish_step(const StepPlan& step, const std::vector<at::Tensor>& parameters);

 private:
  // groups null: the owned ones.
  Runtime(RuntimeOptions options, std::unique_ptr<ProcessGroups> owned, const ProcessGroups* groups);

  PrecisionChoice precision_;  // first: options_.shape takes its bytes
  RuntimeOptions options_;
  std::unique_ptr<ProcessGroups> owned_groups_;
  const ProcessGroups* groups_;
  CostModel cost_;
  MemoryModel memory_;
  double loss_sum_ = 0;
  std::chrono::steady_clock::time_point step_start_;
};

}  // namespace dcp
