// Planners: pure, deterministic functions (samples, world_size, CostModel, MemoryModel, options) -> step plans,
// their predicted cost and lower bound, and the synthetic workloads the simulator plans.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dcp/cost_model.h"
#include "dcp/data.h"
#include "dcp/plan.h"

namespace dcp {

/// How an epoch is cut into steps; shared by every planner so that all of them plan the same steps.
struct PlannerOptions {
  uint64_t seed = 1234;
  int64_t epoch = 0;
  /// > 0: a step takes this many consecutive samples of the epoch order.
  int64_t samples_per_step = 0;
  /// Used when samples_per_step is 0: a step takes consecutive samples while their token sum stays within
  /// this (at least one sample per step).
  int64_t tokens_per_step = 1 << 20;
  /// `packed` and `bucket` only: > 0 fixes their SP size (it must divide world_size and the heads; samples
  /// that do not fit it are skipped); 0 takes the smallest size at which the longest sample fits.
  int64_t static_sp_size = 0;
  /// `dcp-intra`, `dcp-inter` and `dcp-inter-pac` only (the others ignore it): instead of the common steps,
  /// each forms its own iterations as the reference does (dcp-reference.md sections 3.4, 3.5): the epoch's
  /// samples in one pool, each iteration (one StepPlan) one fill of the ranks, SP classes drawn by their number
  /// of buckets, the first group drawn like the others; dcp-intra gives each group one micro-batch, dcp-inter
  /// the gas solver's; iterations follow until the pool is empty. The section 7 fixes stay: nothing is
  /// dropped (tails are kept, ranks the fill leaves idle stay idle), so only unplaceable samples are skipped.
  /// Iterations then differ from the other planners' steps in size and number: for `dcp simulate` only, to
  /// compare with the reference as it runs (its optimizer steps are not ours).
  bool native_iterations = false;
  /// `dcp-opt` only: the modes its groups may take (it chooses per group, sp_layouts_allowed); empty = every
  /// mode the attention runs (sp_modes_allowed). The other planners give their groups Ulysses.
  std::vector<SpMode> sp_modes;
  /// `dcp-opt` only: the most rounds a step may have (StepPlan rounds; train.max_rounds, --max-rounds): 0 = as
  /// many as pay in its cost model, 1 = one partition of the ranks per step. The other planners plan one round.
  int64_t max_rounds = 0;
};

/// A planner's output: the steps of one epoch, and the samples it could not place (no allowed SP size holds
/// them even with every layer recomputed), which are counted, never silently dropped.
struct PlanSet {
  std::vector<StepPlan> steps;
  std::vector<int64_t> skipped_ids;
};

using Planner = std::function<PlanSet(const std::vector<Sample>& samples, int64_t world_size, const CostModel& cost,
                                      const MemoryModel& memory, const PlannerOptions& options)>;

/// The epoch order (epoch_order of all ids with options.seed and options.epoch) cut into steps of sample ids.
/// Throws std::invalid_argument when a sample's id is not its index or both step sizes are non-positive.
std::vector<std::vector<int64_t>> split_steps(const std::vector<Sample>& samples, const PlannerOptions& options);

/// SP sizes a Ulysses group may have: s <= world_size with kv_head_count % s == 0 (Ulysses splits the heads over
/// the group, and KV heads are not replicated).
std::vector<int64_t> sp_sizes_allowed(int64_t world_size, const ModelShape& shape);

/// `modes`, or when it is empty every mode the shape's attention runs: ulysses, ring and ulysses-ring for
/// softmax, ulysses alone for linear attention (a ring merges softmax partial results by their logsumexps).
std::vector<SpMode> sp_modes_allowed(const ModelShape& shape, const std::vector<SpMode>& modes);

/// The group layouts a mode-choosing planner may use on up to world_size ranks with sp_modes_allowed(shape,
/// modes), by SP size ascending and, within a size, Ulysses, ring, ulysses-ring: size 1 once ({1, 1}); for each
/// s >= 2, Ulysses {s, s} when it runs (CostModel::supports: s divides the KV heads); ring {s, 1}; ulysses-ring
/// {s, u} for u = ulysses_ring_size(s, 0, kv heads) (the largest subgroup) and, when different, the largest
/// such u <= gpus_per_node (the Ulysses part inside a node, the ring across: USP's placement, arXiv
/// 2405.07719). A size with no layout is left out. Throws std::invalid_argument when world_size < 1 or a
/// mode in `modes` does not run on the attention (a ring mode with linear attention).
std::vector<SpLayout> sp_layouts_allowed(int64_t world_size, const CostModel& cost, const std::vector<SpMode>& modes);

/// `packed`: one static SP size for the epoch, the smallest allowed divisor of world_size at which the longest
/// sample fits memory with full recompute, and one static recompute count, the fewest layers with which that
/// longest sample fits; world_size / sp groups. Per step, samples go longest-predicted-time first onto the
/// least-loaded group (LPT), then each group packs its samples first-fit decreasing into micro-batches of at
/// most MemoryModel::max_tokens(sp, recompute) tokens. Samples that fit no allowed divisor are skipped.
/// options.static_sp_size > 0 fixes the SP size instead. Throws std::invalid_argument as split_steps does,
/// when world_size < 1, or when static_sp_size is not an allowed divisor of world_size.
PlanSet plan_packed(const std::vector<Sample>& samples, int64_t world_size, const CostModel& cost,
                    const MemoryModel& memory, const PlannerOptions& options);

/// `bucket`: the reference baseline (dcp-reference.md section 3.6) on the same steps as the other planners:
/// static SP size and recompute as in `packed`; samples are put in length buckets of a quarter octave
/// (upper edges 2^(k/4) tokens); each bucket is cut into micro-batches of bs samples, bs = the most samples of
/// the bucket's longest length that fit memory; the step's micro-batches are shuffled (seeded by seed, epoch
/// and step) and dealt round-robin to the data-parallel groups. Unlike the reference, bucket tails are kept
/// and nothing is dropped. Throws as plan_packed.
PlanSet plan_bucket(const std::vector<Sample>& samples, int64_t world_size, const CostModel& cost,
                    const MemoryModel& memory, const PlannerOptions& options);

/// `dcp-intra`: the reference's DCP-intra planner (dcp-reference.md section 3.4: dynamic SP, one micro-batch
/// per group per iteration) on the same steps as the other planners.
///  - Profile per quarter-octave length bucket (as `bucket`), from CostModel and MemoryModel instead of a
///    profiling run (reference 2.3): at every power-of-two allowed size where the bucket's longest sample
///    fits, bs = the most samples of that length within the memory budget and the micro-batch time; the
///    bucket's sp_size is the one of most samples per GPU-second. Recompute is one epoch-wide count (the
///    reference's global checkpointing switch, sized like `bucket`'s): the fewest layers with which every
///    bucket's longest sample fits at its smallest size.
///  - Per step, on the step's samples by bucket (each shuffled by a StepRng of seed, epoch and step): fill the
///    ranks with groups of drawn buckets (an SP class, then a bucket of it uniformly; n = min(bs, left)),
///    retarget every group towards the fastest full group's time (bs, and larger SP sizes up to the largest
///    allowed one; the reference stops at a node, here the cost model prices cross-node groups), drop the
///    smallest groups while the sizes exceed world_size (samples back to the pool), top up faster groups.
///    Each group has one micro-batch.
///  - Adaptation: the class draw is weighted by the GPU-seconds of the class's samples, not by its number of
///    buckets: the reference re-draws a layout every iteration while buckets drain, a step has one layout.
///  - Adaptation: when the step's samples need more than one round, the layout is kept and rounds are added:
///    each round gives every group at most one more micro-batch (its bucket while it lasts, else a bucket of
///    the largest SP class it holds), least loaded groups first, balanced by the same retarget (bs only) and
///    top-up on the groups' accumulated times; a group already past the round's target sits it out.
///  - Bugs fixed (section 7): no sample or bucket tail is dropped (the reference drops tails and discards
///    partial iterations; ranks it cannot fill become groups for later rounds); the first group takes the
///    step's largest SP class, so every bucket has a group that holds it; seeded per-step streams instead of a
///    generator carried across epochs; sizes sorted before placement, so any world_size works (power-of-two
///    groups placed largest first are aligned); sizes divide the heads; every micro-batch fits the budget.
/// With PlannerOptions::native_iterations, the reference's own iterations instead of the common steps.
/// Samples that fit no allowed power-of-two size even with full recompute are skipped. Throws as plan_packed.
PlanSet plan_dcp_intra(const std::vector<Sample>& samples, int64_t world_size, const CostModel& cost,
                       const MemoryModel& memory, const PlannerOptions& options);

/// `dcp-inter`: the reference's DCP-inter planner (dcp-reference.md section 3.5: fixed (sp, bs) per bucket,
/// balance by per-group grad_accum_steps) on the same steps as the other planners.
///  - Profile as dcp-intra; a bucket's micro-batch always has its profiled bs (or what remains) and the
///    epoch-wide recompute count; on a group larger than its SP class it keeps them (it then fits easily).
///  - Per step: fill the ranks as dcp-intra (first micro-batches), then the reference's gas solver (asymmetric
///    error with a 1.2 over-penalty, max 5 and min 2 grad_accum_steps; planner_detail::solve_grad_accum_steps)
///    on the groups' micro-batch times gives each group its grad_accum_steps, and every group takes its
///    further micro-batches from its bucket.
///  - Adaptations: the class draw and the rounds as in dcp-intra (when samples remain, the layout is kept; a
///    group whose bucket ran out serves a bucket of the largest SP class it holds; a round serves the groups
///    below the slowest one, least loaded first, and the solver gives each its micro-batches of the round);
///    each group's gas is capped by the micro-batches its bucket can still give it (the reference instead
///    drops such a group and the rest of its bucket).
///  - Bugs fixed (section 7): no bucket remainder is dropped or padded (partial micro-batches are kept and
///    timed by their real size); the SP class draw uses the cumulative distribution (the reference compares
///    one uniform number with each class's own probability, so a class is picked only when its probability
///    exceeds every smaller class's, and the largest class takes the rest); the first group takes the step's largest class; seeded per-step streams; any world_size;
///    sizes divide the heads; every micro-batch fits the budget.
/// With PlannerOptions::native_iterations, the reference's own iterations instead of the common steps.
/// Skips as dcp-intra. Throws as plan_packed.
PlanSet plan_dcp_inter(const std::vector<Sample>& samples, int64_t world_size, const CostModel& cost,
                       const MemoryModel& memory, const PlannerOptions& options);

/// `dcp-inter-pac`: dcp-inter with Pyramid Activation Checkpointing (dcp-reference.md sections 4 and 2.4):
/// each bucket's (sp_size, bs, recompute_layers) is chosen jointly for the most samples per GPU-second, over
/// every power-of-two allowed size and every recompute count (the reference's knapsack over non-checkpointed
/// layers, exact here because all layers are alike; planner_detail::best_pac_setting). Short buckets thus
/// recompute few or no layers, long ones many. "No PAC" (dcp-intra, dcp-inter) means the one epoch-wide
/// count described at dcp-intra. Unlike the reference's PAC config, min grad_accum_steps stays 2 (the
/// reference uses 15 there, which makes its comparison unfair). Skips and throws as dcp-inter.
PlanSet plan_dcp_inter_pac(const std::vector<Sample>& samples, int64_t world_size, const CostModel& cost,
                           const MemoryModel& memory, const PlannerOptions& options);

/// `dcp-opt`: per step, chooses the groups (power-of-two SP sizes placed largest first, so every group is an
/// aligned block, for any world_size; where world_size is not a power of two, also one group of all the ranks,
/// alone in its layout), assigns samples to groups and packs micro-batches, each with the fewest
/// recompute layers that fit memory, to minimise the step makespan (the largest group time). Heuristic:
///  1. each sample's time t(s) at every allowed size s, with its fewest feasible recompute layers; the fixed
///     per-micro-batch cost is charged in proportion to the share of a no-recompute micro-batch it fills;
///  2. fill(T, floor): each sample prefers, among sizes >= floor, the least GPU-seconds s * t(s) with
///     t(s) <= T (else its fastest); samples go by preferred size then time, both descending, into an open
///     group where they finish by T (least GPU-seconds, then best fit), else open a group of their preferred
///     size while ranks remain; the fill fails when a sample finds no place;
///  3. for every floor, the smallest T the fill meets (to 0.05 %), searched upward from the floor's lower bound
///     B (the smallest T at which the samples' least GPU-seconds among sizes >= floor with t(s) <= T fit in
///     world_size * T: no layout of those sizes has a smaller makespan): steps of B / 128, doubling, until the
///     fill meets one, then bisection; after the first floor, a floor is skipped unless it can beat the best
///     makespan by 0.1 % (its bound, then one fill, must stay below that); ranks left over become more groups;
///     local search then moves or swaps samples of the makespan group while that lowers the pair's maximum;
///     while the best makespan is more than 1 % above floor 0's bound, the best floor is searched again with
///     dense groups for long samples: a sample over T / 2 at its preferred size that opens a group opens the
///     size holding the most of its size's long samples still to place per rank (its copies by T, at most
///     that many, over the size), and the better layout is kept. Least GPU-seconds alone gives each such
///     sample its own group and can run out of ranks: four 432k-token samples on 24 ranks ran two at a time on
///     groups of 8 (31.1 s) where three on 16 ranks and one on 8 take 26.4 s;
///     while the best makespan is more than 5 % above floor 0's bound (coarse steps, few samples per group),
///     the best floor is retried at looser targets (1.02 T .. 1.5 T) and the best layout kept;
///  4. each group packs its samples first-fit decreasing, merging a sample into a micro-batch only when that is
///     not slower than running it alone.
/// No approximation factor is proven; a unit test checks the makespan against brute force (every layout of the
/// same sizes and every assignment) on tiny cases. Throws as plan_packed.
PlanSet plan_dcp_opt(const std::vector<Sample>& samples, int64_t world_size, const CostModel& cost,
                     const MemoryModel& memory, const PlannerOptions& options);

/// Planner names in table order: "bucket", "packed", "dcp-intra", "dcp-inter", "dcp-inter-pac", "dcp-opt".
std::vector<std::string> planner_names();
/// The planner called `name`; throws std::invalid_argument listing the known names.
Planner planner_by_name(const std::string& name);

/// Predicted cost of one step; a group's time is the sum of its micro-batches' CostModel::seconds.
struct StepCost {
  /// Sum over the rounds of the round's largest group time, seconds (one round: the largest group time)
  double makespan_s = 0;
  double mean_rank_s = 0;   ///< mean over ranks of their groups' times summed over the rounds, seconds
  /// makespan_s + CostModel::round_seconds(rounds) + CostModel::step_seconds(world_size)
  double step_s = 0;
  double peak_bytes = 0;    ///< largest MemoryModel::bytes over the micro-batches of every round
  std::vector<double> round_makespan_s;  ///< per round: its largest group time, seconds
};
/// A group's time uses its layout (GroupPlan::layout()), its memory the SP size alone (MemoryModel). Rounds run
/// one after the other, each as long as its slowest group, and each switch costs DeviceSpec::round_switch_s.
StepCost evaluate_step(const StepPlan& plan, const std::vector<Sample>& samples, int64_t world_size,
                       const CostModel& cost, const MemoryModel& memory);

/// Lower bound on the seconds of any plan of these samples as one step on world_size ranks with the group
/// layouts of sp_layouts_allowed(world_size, cost, modes) (empty modes: every mode the attention runs, so the
/// bound holds for every planner), any number of rounds: the largest of five terms (docs/planners.md, "The lower
/// bound of the larger plan space") + step_seconds(world_size):
///   1. max_i f_i, f_i = min over feasible layouts l of seconds({len_i}, l, r_i(s)), s = l.sp_size;
///   2. sum_i g_i / world_size, g_i = min over feasible l and recompute counts q >= r_i(s) of
///      s * (work_seconds(len_i, l, q) + fixed_seconds(l, q) * len_i / c(s, q)), c(s, q) the most tokens any
///      micro-batch on s ranks at q holds;
///   3. sum_i w_i / world_size + micro_batch_overhead_s (w_i: least GPU-seconds of the work alone);
///   4. for k = 1..3, samples that need groups of more than world_size / (k + 1) ranks run at most k at once;
///   5. the smallest M with sum_i c_i(M) <= world_size * M, c_i(M) the least GPU-seconds of sample i over the
///      layouts it can run on within M seconds.
/// r_i(s) = MemoryModel::min_recompute_layers. It holds because time is additive over the samples of a
/// micro-batch, packing never lowers a sample's recompute count, and a group of s ranks for t seconds spends
/// s * t GPU-seconds, at most world_size * makespan in all. Samples that fit no size are left out. Throws
/// std::invalid_argument for an unknown id.
/// The SP modes a planner's groups may use, for its step_lower_bound: `requested` (PlannerOptions::sp_modes) for
/// dcp-opt, the only planner that honours it; every mode (empty) for the others, which plan Ulysses groups
/// whatever is requested.
std::vector<SpMode> planner_sp_modes(const std::string& planner, const std::vector<SpMode>& requested);

double step_lower_bound(const std::vector<int64_t>& ids, const std::vector<Sample>& samples, int64_t world_size,
                        const CostModel& cost, const MemoryModel& memory, const std::vector<SpMode>& modes = {});

/// Built-in workloads, lengths in tokens.
struct WorkloadOptions {
  std::string name = "opensora-zipf";  ///< opensora-zipf | lognormal | megatron-lognormal | uniform
  int64_t num_samples = 8000;          ///< lognormal and uniform
  uint64_t seed = 1234;
  int64_t min_tokens = 1024;           ///< lognormal (clip) and uniform
  int64_t max_tokens = 262144;
  double lognormal_median = 8192;      ///< tokens; exp(mu)
  double lognormal_sigma = 1.2;
  int64_t zipf_data_size = 4000;       ///< opensora-zipf: videos; images = zipf_image_frac * data size
  int64_t zipf_image_frac = 1;
  double zipf_alpha = 1.05;            ///< the 32-GPU runs of the reference (dcp-reference.md section 1.4)
  int64_t zipf_offset = 15;
};

/// opensora-zipf: the 20 video buckets (144p..720p x 51/102/204/408 frames) sorted ascending by frames x height
/// (ties keep resolution-then-frames order) and the 5 image buckets sorted by height, with the patch-token
/// counts of dcp-reference.md section 1.2; count_i = round_half_even(n (i+1+offset)^-alpha / sum_j ...), the
/// rounding remainder added to bucket 0, n = data size for videos and frac * data size for images. Lengths come
/// in bucket order (the planners shuffle). lognormal: exp(N(ln median, sigma)) rounded and clipped to
/// [min, max]; uniform: integers uniform in [min, max]; both from a SplitMix64 stream of `seed`.
/// megatron-lognormal: the lengths of Megatron-Core's dynamic context parallelism benchmark (lognormal 128-8192
/// tokens, mean 1024; NVIDIA's Dynamic-CP blog, anchors-parallel-training.md section 1.2): lognormal with sigma 1
/// and median 631.3 tokens (the clipped mean is then 1024), clipped to [128, 8192], whatever min, max, median
/// and sigma say; num_samples and seed apply. Throws std::invalid_argument for an unknown name or non-positive
/// sizes.
std::vector<int64_t> workload_lengths(const WorkloadOptions& options);

/// Tokens per rank of a step of the named workload (`dcp simulate` / `dcp plan` without --tokens-per-step take
/// world_size times this): 16384 for megatron-lognormal (8 micro-batches of its 2048-token rank capacity), else
/// 131072.
int64_t workload_tokens_per_rank(const std::string& name);
/// The named workload's per-rank token capacity of one micro-batch, or 0 when it has none: 2048 for
/// megatron-lognormal (Megatron-Core's `max_seqlen_per_dp_cp_rank` in its dynamic-CP benchmark: a sample of at
/// most that many tokens runs on one rank, a longer one on a CP group of ceil(len / 2048) rounded up to a power
/// of two; anchors-parallel-training.md 1.2). `dcp simulate` / `dcp plan` without --memory-budget-bytes turn it
/// into the per-rank memory budget: the memory model's peak for a micro-batch of that many tokens on one rank
/// without recompute (dcp may still recompute to fit more, which Megatron's scheduler does not).
int64_t workload_rank_capacity_tokens(const std::string& name);

/// One positive integer per line (surrounding blanks allowed, empty lines skipped). Throws std::runtime_error
/// naming the file (and the line number and text of a bad line) when it cannot be read, a line is not a
/// positive integer, or no length is found.
std::vector<int64_t> read_lengths_file(const std::string& path);

/// Samples with ids 0..n-1, the given lengths and source "<prefix>#<id>".
std::vector<Sample> samples_from_lengths(const std::vector<int64_t>& lengths, const std::string& prefix);

}  // namespace dcp
