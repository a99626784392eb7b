// Plans for training: a dcp model config seen by the planners, and an epoch planned over the training samples.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "dcp/config.h"
#include "dcp/planners.h"

namespace dcp {

/// The planners' view of a dcp model: SwiGLU (3 MLP matrices), the byte vocabulary, `bytes_per_element` (2 for
/// bf16, 4 for fp32: activation_bytes of the run's precision, dcp/precision.h) and the attention of
/// cfg.attention (with_attention).
ModelShape model_shape_of(const Config& cfg, int64_t bytes_per_element = 2);

/// `shape` with the attention operator of `attention`: softmax, or for backend flexformer linear attention with
/// feature_dim F = 2 num_features (trig maps) or hidden / heads (elu), plus 1 for normalizer shift (the prepended
/// alpha, as FlexformerAttention::feature_dim); feature_projections = num_features (stationary, fixed),
/// 2 num_features (nonstationary) or 0 (elu); chunk_size = attention.chunk_size for mode chunk, 1 for recurrent
/// (token by token is the chunked form with C = 1, up to its 1x1 scores) and 0 for quadratic. The one mapping
/// from a config to the cost model's attention; every caller goes through it. Throws std::invalid_argument for
/// a backend, feature_map or mode it does not know (Config::set already refuses them).
ModelShape with_attention(ModelShape shape, const AttentionConfig& attention);

/// Per-rank memory budget, bytes: memory.budget_bytes, or memory.fraction x device.memory_bytes when it is 0.
double memory_budget_bytes(const MemoryConfig& memory, const DeviceSpec& device);

/// The MemoryModel of a cost model name (train.cost_model, --cost-model) with the planning budget of `memory`
/// (memory_budget_bytes of `device`, the DeviceSpec::named of the same name, times 1 - memory.margin): "h200"
/// gives the analytic model of
/// `shape`; a `dcp profile` JSON file gives its fitted model (MemoryModel::from_profile) with
/// `longest_sample_tokens` (the longest sample the planners will see, tokens; 0 = no bound). Throws
/// std::invalid_argument naming the file and both precisions when the profile was measured in another precision
/// (bytes_per_element: its time and memory fits do not carry over), naming the file and both shapes when it
/// measured another model, attention kind included (its memory fit, and for another kind its attention rate,
/// does not carry over: rerun `dcp profile` with this model), and what MemoryModel throws.
MemoryModel memory_model_for(const std::string& cost_model, const ModelShape& shape, const DeviceSpec& device,
                             const MemoryConfig& memory, int64_t longest_sample_tokens);

/// The device models a training run plans with, resolved from train.cost_model before the trainer is built
/// (resolve_cost_models in dcp/profile.h: auto profiles this machine, a name or a file is read).
struct RunCostModels {
  std::string source;  ///< "h200" or the `dcp profile` JSON file (train.cost_model auto resolved to its cache)
  CostModel cost;      ///< step times of the run's model shape on source's device
  MemoryModel memory;  ///< per-rank peak bytes and the budget (memory.budget_bytes or memory.fraction)
};

/// What one sample of `length` tokens needs under a memory budget: the smallest SP size that fits it and the
/// fewest recomputed layers at that size (MemoryModel::bytes of the one-sample micro-batch).
struct LengthNeed {
  int64_t length = 0;            ///< tokens
  int64_t sp_size = 0;           ///< 0 when no SP size fits even with every layer recomputed
  int64_t recompute_layers = 0;  ///< at sp_size
  double bytes = 0;              ///< predicted peak bytes per rank at that choice (at the largest SP size if none fits)
};

/// The LengthNeed of one sample of `length` tokens over `sp_sizes` (ascending): the first size, then the fewest
/// recomputed layers there, at which MemoryModel::bytes of the one-sample micro-batch is within the budget.
/// Throws std::invalid_argument when sp_sizes is empty or length < 1.
LengthNeed length_need(const MemoryModel& memory, const std::vector<int64_t>& sp_sizes, int64_t length);

/// length_need at powers of two from 256 up to, and at, `longest` tokens, over `sp_sizes` (ascending). Throws
/// std::invalid_argument when sp_sizes is empty or longest < 1.
std::vector<LengthNeed> memory_needs(const MemoryModel& memory, const std::vector<int64_t>& sp_sizes,
                                     int64_t longest);

/// The static planner sized by `train.planner static` with parallel.sp_size 0.
struct StaticSizing {
  /// The caller's options with sp_size and recompute_layers of `longest`, and micro_batch_tokens at most what
  /// the budget holds per rank there (MemoryModel::max_tokens / sp_size), as packed and bucket size themselves.
  DataParallelOptions options;
  LengthNeed longest;  ///< the longest of the lengths that fits some SP size, and what it needs
  /// Samples longer than this (tokens) are skipped: they fit no SP size even with every layer recomputed, or
  /// not one micro-batch of options (micro_batch_tokens x sp_size, rounded down from the memory bound).
  int64_t max_sample_tokens = 0;
};

/// Sizes the static planner to the longest of `lengths` (tokens; the training samples) that fits the memory
/// budget at some size of `sp_sizes` (ascending; length_need, a sample needing more the longer it is), so that
/// only samples that nothing fits are left out, as the other planners leave them out. Throws ConfigError (exit 2)
/// naming the budget, the SP sizes and the bytes of the shortest sample when no length fits, and
/// std::invalid_argument when lengths or sp_sizes is empty.
StaticSizing size_static_planner(const DataParallelOptions& options, const MemoryModel& memory,
                                 const std::vector<int64_t>& sp_sizes, std::vector<int64_t> lengths);

/// memory_needs as one line, runs of lengths with the same need merged: "<= 2048 tokens: sp 1; 4096: sp 1,
/// recompute 2 layers; 16384: sp 2, recompute 4 layers".
std::string describe_memory_needs(const std::vector<LengthNeed>& needs);

/// One epoch of the training samples planned by `planner` (a name of planner_names()): the planner sees the
/// training samples as a dense list, and the plans it returns are mapped back to corpus sample ids. Samples
/// the planner cannot place (no SP size fits memory) are returned in `skipped_ids` (corpus ids).
/// Throws ConfigError (the CLI's exit 2) when no training sample fits the memory budget (the message gives the
/// budget and the bytes of the shortest sample with every layer recomputed; the trainer would otherwise loop
/// over empty epochs), std::invalid_argument for an unknown planner name, and what the planner throws.
PlanSet plan_training_epoch(const std::string& planner, const std::vector<Sample>& samples,
                            const std::vector<int64_t>& train_ids, int64_t epoch, int64_t world_size,
                            const CostModel& cost, const MemoryModel& memory, const PlannerOptions& options);

}  // namespace dcp
