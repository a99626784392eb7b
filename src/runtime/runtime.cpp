#include "dcp/runtime.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <stdexcept>

#include "dcp/memory_meter.h"
#include "dcp/model.h"
#include "dcp/planning.h"
#include "dcp/sequence_parallel.h"
#include "util/clock.h"

namespace dcp {
namespace {

thread_local MicroBatchContext current_context;

// Lets a user's attention function stand where the Ulysses wrapper expects a backend.
class FunctionAttention : public AttentionBackend {
 public:
  explicit FunctionAttention(const AttentionFn& fn) : fn_(fn) {}
  torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& cu_seqlens) const override {
    return fn_(q, k, v, cu_seqlens);
  }

 private:
  const AttentionFn& fn_;
};

}  // namespace

int64_t ShardRange::num_tokens() const {
  int64_t n = 0;
  for (const auto& [begin, end] : pieces) n += end - begin;
  return n;
}

ShardRange shard_range(const std::vector<int64_t>& lengths, int64_t sp_rank, const SpLayout& layout) {
  if (lengths.empty()) throw std::invalid_argument("shard_range: empty list of sample lengths");
  if (layout.sp_size < 1 || sp_rank < 0 || sp_rank >= layout.sp_size) {
    throw std::invalid_argument(
        fmt::format("shard_range: sp_rank {} outside [0, sp_size {})", sp_rank, layout.sp_size));
  }
  ShardRange r;
  r.cu_seqlens.reserve(lengths.size() + 2);
  r.cu_seqlens.push_back(0);
  for (int64_t len : lengths) {
    if (len < 1) throw std::invalid_argument(fmt::format("shard_range: sample length {} is not positive", len));
    r.cu_seqlens.push_back(r.cu_seqlens.back() + len);
  }
  const int64_t total = r.cu_seqlens.back();
  const int64_t padded = layout.padded_length(total);
  if (padded > total) r.cu_seqlens.push_back(padded);
  r.pieces = layout.shard(padded, sp_rank);
  return r;
}

MicroBatchScope::MicroBatchScope(const MicroBatchContext& context) : previous_(current_context) {
  current_context = context;
}
MicroBatchScope::~MicroBatchScope() { current_context = previous_; }

const MicroBatchContext& current_micro_batch() { return current_context; }

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                        const torch::Tensor& cu_seqlens, const AttentionFn& fn) {
  const MicroBatchContext& ctx = current_context;
  if (ctx.sp_group == nullptr || ctx.sp_size == 1) return fn(q, k, v, cu_seqlens);
  if (ctx.sp_mode != SpMode::kUlysses) {
    throw std::invalid_argument(fmt::format(
        "dcp::attention: the micro-batch's group uses sp_mode {}, which dcp::attention does not serve (a ring merges "
        "softmax results by their logsumexps, which a user's attention function does not return); plan with "
        "Ulysses groups only",
        sp_mode_name(ctx.sp_mode)));
  }
  SequenceParallelAttention ulysses(std::make_shared<FunctionAttention>(fn), *ctx.sp_group);
  return ulysses.forward(q, k, v, cu_seqlens);
}

torch::Tensor layer(int64_t index, const std::function<torch::Tensor(const torch::Tensor&)>& fn,
                    const torch::Tensor& x) {
  const MicroBatchContext ctx = current_context;
  if (index >= ctx.recompute_layers) return fn(x);
  // Backward reruns fn after this frame and the caller's scope may be gone: keep fn and the context.
  return recompute(
      [fn, ctx](const torch::Tensor& h) {
        MicroBatchScope scope(ctx);
        return fn(h);
      },
      x);
}

void check_same_plan(const StepPlan& plan, const Communicator& world) {
  const int64_t h = plan.hash();
  auto t = torch::tensor({h, -h}, torch::kInt64);
  world.allreduce_max(t);
  const int64_t max_h = t[0].item<int64_t>(), min_h = -t[1].item<int64_t>();
  if (max_h != h || min_h != h) {
    throw std::runtime_error(fmt::format(
        "step plan mismatch at epoch {} step {}: rank {} holds plan hash {}, ranks hold hashes in [{}, {}]",
        plan.epoch, plan.index, world.rank(), h, min_h, max_h));
  }
}

std::vector<MicroBatchWork> rank_micro_batches(const StepPlan& plan, const std::vector<int64_t>& lengths,
                                               const ProcessGroups& groups, int64_t heads) {
  if (plan.global_num_tokens <= 0) {
    throw std::invalid_argument(fmt::format("step plan (epoch {}, index {}) has no tokens", plan.epoch, plan.index));
  }
  const int64_t rounds = plan.num_rounds();
  for (const auto& g : plan.groups) {  // checked on every rank before any work, so all ranks fail alike
    if (layout_fits_heads(g.layout(), heads)) continue;
    const bool ring = g.sp_mode == SpMode::kUlyssesRing;
    throw std::invalid_argument(fmt::format(
        "step plan (epoch {}, index {}): {} {} does not divide the K/V heads {} (model.n_kv_heads, n_heads without "
        "grouped-query attention; the group at rank {}{}: Ulysses shards heads; sp_mode ring does not)",
        plan.epoch, plan.index, ring ? "ulysses_size" : "sp_size", ring ? g.ulysses_size : g.sp_size, heads,
        g.first_rank, rounds > 1 ? fmt::format(" in round {}", g.round) : ""));
  }
  const int64_t rank = groups.world().rank();
  std::vector<MicroBatchWork> out;
  for (int64_t round = 0; round < rounds; ++round) {
    const GroupPlan& group = plan.group_of(rank, round);
    const Communicator& sp_group = groups.group(group.sp_size);
    const SpLayout layout = group.layout();
    for (size_t m = 0; m < group.micro_batches.size(); ++m) {
      const MicroBatch& mb = group.micro_batches[m];
      std::vector<int64_t> mb_lengths;
      for (int64_t id : mb.sample_ids) {
        if (id < 0 || id >= static_cast<int64_t>(lengths.size())) {
          throw std::invalid_argument(fmt::format("step plan (epoch {}, index {}) names sample {} but only {} "
                                                  "lengths are known",
                                                  plan.epoch, plan.index, id, lengths.size()));
        }
        mb_lengths.push_back(lengths[static_cast<size_t>(id)]);
      }
      MicroBatchWork w;
      w.sample_ids = mb.sample_ids;
      w.shard = shard_range(mb_lengths, sp_group.rank(), layout);
      w.context = MicroBatchContext{group.sp_size > 1 ? &sp_group : nullptr, group.sp_size, sp_group.rank(),
                                    mb.recompute_layers, group.sp_mode};
      w.round = round;
      w.group_first_rank = group.first_rank;
      w.layout = layout;
      w.index = static_cast<int64_t>(m);
      out.push_back(std::move(w));
    }
  }
  return out;
}

std::string describe_work(const StepPlan& plan, const MicroBatchWork& work) {
  const std::string mode = work.layout.sp_size == 1 ? "none"
                           : work.context.sp_mode == SpMode::kUlyssesRing
                               ? fmt::format("ulysses-ring, ulysses_size {}", work.layout.ulysses_size)
                               : sp_mode_name(work.context.sp_mode);
  return fmt::format("step plan (epoch {}, index {}), {}the group at rank {} (sp_size {}, sp_mode {}), micro_batch {}",
                     plan.epoch, plan.index,
                     plan.num_rounds() > 1 ? fmt::format("round {} of {}, ", work.round, plan.num_rounds()) : "",
                     work.group_first_rank, work.layout.sp_size, mode, work.index);
}

StepStats reduce_step(const StepPlan& plan, const std::vector<torch::Tensor>& parameters, double loss_sum,
                      double busy_s, int64_t peak_bytes, const Communicator& world,
                      const std::vector<double>& round_s) {
  // Gradients, then the loss, each rank's busy time in its own slot, its peak bytes in two slots and its
  // seconds per round in `rounds` slots. float32 holds integers below 2^24 exactly, so the peak travels as
  // (peak / 2^24, peak mod 2^24); the other ranks add zeros there, which keeps both parts exact up to 2^48 bytes.
  const int64_t world_size = world.size();
  const int64_t rounds = plan.num_rounds();
  if (!round_s.empty() && static_cast<int64_t>(round_s.size()) != rounds) {
    throw std::invalid_argument(fmt::format("reduce_step: {} round times for a plan of {} rounds", round_s.size(),
                                            rounds));
  }
  constexpr int64_t kSplit = int64_t{1} << 24;
  std::vector<torch::Tensor> parts;
  parts.reserve(parameters.size() + 1);
  for (const auto& p : parameters) {
    parts.push_back(p.grad().defined() ? p.grad().reshape(-1) : torch::zeros({p.numel()}, p.options()));
  }
  const int64_t round_base = 1 + 3 * world_size;
  auto extra = torch::zeros({round_base + rounds * world_size},
                            parameters.empty() ? torch::kFloat32 : parameters[0].scalar_type());
  extra[0] = loss_sum;
  extra[1 + world.rank()] = busy_s;
  extra[1 + world_size + 2 * world.rank()] = static_cast<double>(peak_bytes / kSplit);
  extra[2 + world_size + 2 * world.rank()] = static_cast<double>(peak_bytes % kSplit);
  for (size_t r = 0; r < round_s.size(); ++r) {
    extra[round_base + static_cast<int64_t>(r) * world_size + world.rank()] = round_s[r];
  }
  parts.push_back(extra);
  torch::Tensor flat = torch::cat(parts);
  world.allreduce_sum(flat);

  int64_t offset = 0;
  for (const auto& p : parameters) {
    torch::Tensor handle = p;  // shares p's storage and grad slot
    handle.mutable_grad() = flat.slice(0, offset, offset + p.numel()).view(p.sizes()).clone();
    offset += p.numel();
  }
  StepStats s;
  s.tokens = plan.global_num_tokens;
  s.samples = static_cast<int64_t>(plan.sample_ids().size());
  auto slots = flat.slice(0, offset).to(torch::kFloat64);
  const double* v = slots.data_ptr<double>();
  s.loss = v[0] / static_cast<double>(plan.global_num_tokens);
  for (int64_t i = 0; i < world_size; ++i) {
    s.rank_busy_s.push_back(v[1 + i]);
    s.rank_peak_bytes.push_back(static_cast<int64_t>(v[1 + world_size + 2 * i]) * kSplit +
                                static_cast<int64_t>(v[2 + world_size + 2 * i]));
  }
  if (!round_s.empty()) {
    s.rank_round_s.assign(static_cast<size_t>(world_size), std::vector<double>(static_cast<size_t>(rounds)));
    for (int64_t r = 0; r < rounds; ++r) {
      for (int64_t i = 0; i < world_size; ++i) {
        s.rank_round_s[static_cast<size_t>(i)][static_cast<size_t>(r)] = v[round_base + r * world_size + i];
      }
    }
  }
  return s;
}

namespace {

std::unique_ptr<ProcessGroups> make_groups(const RuntimeOptions& o) {
  const DistEnv env = DistEnv::from_environment();
  return std::make_unique<ProcessGroups>(env, o.timeout_s, resolve_sp_sizes(o.sp_sizes, env.world_size));
}

RuntimeOptions with_precision_bytes(RuntimeOptions o, Precision precision) {
  o.shape.bytes_per_element = activation_bytes(precision);
  return o;
}

}  // namespace

Runtime::Runtime(RuntimeOptions options) : Runtime(options, make_groups(options), nullptr) {}

Runtime::Runtime(RuntimeOptions options, const ProcessGroups& groups)
    : Runtime(std::move(options), nullptr, &groups) {}

Runtime::Runtime(RuntimeOptions options, std::unique_ptr<ProcessGroups> owned, const ProcessGroups* groups)
    : precision_(resolve_precision(options.precision)),
      options_(with_precision_bytes(std::move(options), precision_.precision)),
      owned_groups_(std::move(owned)),
      groups_(groups ? groups : owned_groups_.get()),
      cost_(options_.shape, DeviceSpec::named(options_.cost_model)),
      memory_(memory_model_for(options_.cost_model, options_.shape, cost_.device(), options_.memory, 0)) {
  planner_by_name(options_.planner);  // fail at start-up, not at the first epoch
}

PlanSet Runtime::plan_epoch(const std::vector<int64_t>& lengths, int64_t epoch) const {
  PlannerOptions opt;
  opt.seed = options_.seed;
  opt.epoch = epoch;
  opt.tokens_per_step = options_.tokens_per_step;
  opt.sp_modes = {SpMode::kUlysses};  // dcp::attention wraps the user's own function, which a ring cannot merge
  return planner_by_name(options_.planner)(samples_from_lengths(lengths, "sample"), world_size(), cost_, memory_,
                                           opt);
}

std::vector<MicroBatchWork> Runtime::micro_batches(const StepPlan& step, const std::vector<int64_t>& lengths) {
  check_same_plan(step, groups_->world());
  loss_sum_ = 0;
  MemoryMeter::reset_peak();
  step_start_ = std::chrono::steady_clock::now();
  return rank_micro_batches(step, lengths, *groups_, options_.shape.heads);
}

void Runtime::backward(const torch::Tensor& loss_sum, const StepPlan& step) {
  (loss_sum / static_cast<double>(step.global_num_tokens)).backward();
  loss_sum_ += loss_sum.item<double>();
}

StepStats Runtime::finish_step(const StepPlan& step, const std::vector<torch::Tensor>& parameters) {
  StepStats s = reduce_step(step, parameters, loss_sum_, seconds_since(step_start_), MemoryMeter::peak_bytes(),
                            groups_->world());
  loss_sum_ = 0;
  return s;
}

}  // namespace dcp
