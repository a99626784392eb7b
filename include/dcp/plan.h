// StepPlan: what every rank does in one global step. Pure data, no tensors; see docs/step_plan.md.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dcp/data.h"
#include "dcp/sp_layout.h"

namespace dcp {

/// One forward+backward on one group of ranks: the samples packed into one token stream.
struct MicroBatch {
  std::vector<int64_t> sample_ids;
  int64_t num_tokens = 0;        ///< sum of the samples' lengths, tokens
  int64_t recompute_layers = 0;  ///< the first N layers recompute activations in backward
};

/// A block of consecutive ranks [first_rank, first_rank + sp_size) that runs its micro-batches in order with
/// the sequence split over its sp_size ranks.
struct GroupPlan {
  int64_t first_rank = 0;
  int64_t sp_size = 1;
  std::vector<MicroBatch> micro_batches;  ///< grad_accum_steps = micro_batches.size(); may be empty
  SpMode sp_mode = SpMode::kUlysses;      ///< irrelevant when sp_size is 1
  int64_t ulysses_size = 0;               ///< kUlyssesRing only: ranks per Ulysses subgroup (1 < it < sp_size)
  /// The round of the step (0-based) in which the group runs: a step's rounds run one after the other, and the
  /// groups of one round partition the ranks (docs/step_plan.md, "Rounds").
  int64_t round = 0;

  /// The group's layout: (sp_size, sp_size) for Ulysses, (sp_size, 1) for ring, (sp_size, ulysses_size).
  /// Throws std::invalid_argument for an ulysses-ring group whose ulysses_size does not divide sp_size.
  SpLayout layout() const;
};

/// One global step: an ordered list of rounds, each a set of groups that partition the ranks, and the number of
/// target tokens of the whole step, by which every token loss is divided so the step gradient is that of the
/// mean token loss. A rank runs its group's micro-batches of round 0, then of round 1, ...; gradients accumulate
/// over every round and one reduction ends the step. A one-round plan is the classic layout (one partition of the
/// ranks per step; every plan written before rounds existed), and its JSON is the same as before.
struct StepPlan {
  int64_t epoch = 0;
  int64_t index = 0;                  ///< step index inside the epoch
  /// The groups of every round, listed by round (GroupPlan::round, non-decreasing; rounds 0..num_rounds()-1).
  std::vector<GroupPlan> groups;
  int64_t global_num_tokens = 0;      ///< tokens, = sum over all micro-batches of num_tokens

  /// Every sample id of the step: groups in order (so rounds in order), micro-batches in order.
  std::vector<int64_t> sample_ids() const;

  /// 1 + the largest GroupPlan::round (1 for a plan without groups).
  int64_t num_rounds() const;

  /// The group of round `round` that holds `rank`; throws std::out_of_range naming the rank and the round when
  /// none does.
  const GroupPlan& group_of(int64_t rank, int64_t round = 0) const;

  /// Checks every round: its groups partition [0, world_size) into aligned blocks (first_rank % sp_size == 0),
  /// recompute_layers is within [0, n_layers], a kUlyssesRing group's ulysses_size divides its sp_size and lies
  /// strictly between 1 and it (other modes: 0); and the step: groups are listed by round with no round left
  /// empty, token counts add up against `samples`, no sample id appears twice (in one micro-batch, two groups or
  /// two rounds). Throws std::invalid_argument describing the first violation; in a plan of several rounds the
  /// message names the round ("round 1: group at rank 2 ...").
  void validate(int64_t world_size, const std::vector<Sample>& samples, int64_t n_layers) const;

  /// Canonical JSON text (schema in docs/step_plan.md) and its inverse: one round as a top-level "groups" list
  /// (the format of every plan written before rounds), several as "rounds": [{"groups": [...]}, ...]. from_json
  /// reads either (not both) and throws std::invalid_argument naming the missing or malformed field and its round.
  std::string to_json() const;
  static StepPlan from_json(const std::string& text);

  /// 62-bit FNV-1a hash of the canonical JSON; ranks compare it before executing the step.
  int64_t hash() const;
};

/// Reads a JSON list of StepPlans (or one StepPlan) from a file; throws std::runtime_error naming the file when
/// it is unreadable, malformed or holds no step.
std::vector<StepPlan> load_plans(const std::string& path);
/// Writes a JSON list of StepPlans.
void save_plans(const std::string& path, const std::vector<StepPlan>& plans);

/// The epoch's training order: a Fisher-Yates shuffle of `ids` driven by a SplitMix64 stream seeded with
/// (seed, epoch); identical on every platform and rank.
std::vector<int64_t> epoch_order(const std::vector<int64_t>& ids, uint64_t seed, int64_t epoch);

/// First-fit decreasing: `ids` (longest first) go, in order, into the first micro-batch with room for them,
/// each of at most `capacity` tokens and with `recompute_layers`. A sample longer than capacity gets a
/// micro-batch of its own.
std::vector<MicroBatch> pack_first_fit(const std::vector<Sample>& samples, const std::vector<int64_t>& ids,
                                       int64_t capacity, int64_t recompute_layers);

/// Options of the static data-parallel planner.
struct DataParallelOptions {
  int64_t world_size = 1;
  int64_t global_batch_tokens = 16384;  ///< a step takes samples in order while its token sum stays within this
  int64_t micro_batch_tokens = 4096;    ///< packing capacity of one micro-batch
  int64_t recompute_layers = 0;
  int64_t sp_size = 1;                  ///< every group has this many ranks; must divide world_size
  SpMode sp_mode = SpMode::kUlysses;    ///< of every group with sp_size > 1
  int64_t ulysses_size = 0;             ///< kUlyssesRing: GroupPlan::ulysses_size
};

/// Static plans for one epoch, world_size / sp_size groups of sp_size ranks each: consecutive samples of
/// `order` form a step (at least one sample, at most global_batch_tokens unless one sample alone is longer);
/// the step's samples go longest-first onto the least-loaded group (LPT), and each group packs its samples
/// first-fit decreasing into micro-batches of at most micro_batch_tokens * sp_size tokens. Every sample of `order` appears in exactly one step.
/// Throws std::invalid_argument when a sample does not fit one micro-batch, an option is not positive, or
/// sp_size does not divide world_size.
std::vector<StepPlan> plan_data_parallel(const std::vector<Sample>& samples, const std::vector<int64_t>& order,
                                         int64_t epoch, const DataParallelOptions& opt);

}  // namespace dcp
