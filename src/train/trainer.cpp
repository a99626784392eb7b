#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <thread>

#include "dcp/memory_meter.h"
#include "dcp/planning.h"
#include "dcp/precision.h"
#include "profile/profiler.h"
#include "dcp/step_runner.h"
#include "dcp/trainer.h"
#include "dcp/checkpoint.h"
#include "train/data_fingerprint.h"
#include "train/run_dir_lock.h"
#include "train/step_guard.h"
#include "runtime/optimizer.h"
#include "profile/cache.h"
#include "train/progress.h"
#include "train/run_record.h"
#include "util/file_write.h"
#include "util/logging.h"
#include "util/clock.h"

namespace dcp {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Identical seeds give identical initial weights on every rank; check it rather than trust it.
void check_same_weights(Transformer& model, const Communicator& world) {
  double sum = 0;
  for (const auto& p : model->parameters()) sum += p.to(torch::kFloat64).sum().item<double>();
  auto t = torch::tensor({sum, -sum}, torch::kFloat64);
  world.allreduce_max(t);
  if (t[0].item<double>() != sum || -t[1].item<double>() != sum) {
    throw std::runtime_error(fmt::format("rank {} starts from different weights than its peers (checksum {})",
                                         world.rank(), sum));
  }
}

// Ranks started with different configs (a node's file edited, an override on one host) would exchange tensors of
// different shapes (Gloo aborts) or silently train different schedules; compare a hash of what must agree.
void check_same_config(const Config& cfg, const Communicator& world) {
  std::string text;
  for (const auto& [key, value] : cfg.items()) {
    if (key == "run.dir" || key == "run.log_level" || key == "train.threads" || key == "train.profile_dir") continue;
    text += key + "=" + value + "\n";
  }
  const uint64_t h = fnv1a64(text);
  const auto hi = static_cast<double>(h >> 32), lo = static_cast<double>(h & 0xffffffffu);  // exact in fp64
  auto t = torch::tensor({hi, lo, -hi, -lo}, torch::kFloat64);
  world.allreduce_max(t);  // max of x and of -x agree with this rank's only when every rank has the same x
  if (t[0].item<double>() != hi || t[1].item<double>() != lo || -t[2].item<double>() != hi ||
      -t[3].item<double>() != lo) {
    throw std::runtime_error(fmt::format(
        "rank {}'s config differs from a peer's (another --config file or override on some host): every key but "
        "run.dir, run.log_level, train.threads and train.profile_dir must agree (this rank's hash {:016x})",
        world.rank(), h));
  }
}

// On resume, lines past the checkpoint belong to steps that will run again. A crash or a full disk can leave a
// partial last line: it is dropped with a warning; a bad line before the last one is someone's edit and refused.
void truncate_metrics(const fs::path& path, int64_t keep_through_step) {
  std::vector<std::string> lines;
  if (keep_through_step > 0) {
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) lines.push_back(line);
  }
  while (!lines.empty() && lines.back().empty()) lines.pop_back();
  std::string text;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (lines[i].empty()) continue;
    json j;
    try {
      j = json::parse(lines[i]);
    } catch (const std::exception& e) {
      if (i + 1 == lines.size()) {
        spdlog::warn("{}: dropped its partial last line {} (left by a crash or a full disk): {:.60}",
                     path.string(), i + 1, lines[i]);
        continue;
      }
      throw std::runtime_error(fmt::format("metrics '{}' line {} is not JSON ({}); remove or repair the line",
                                           path.string(), i + 1, e.what()));
    }
    if (j.value("step", int64_t{0}) <= keep_through_step) text += lines[i] + "\n";
  }
  // Through a new file and a rename: a crash or a full disk during the rewrite leaves the old file whole.
  write_file_atomically(path, text);
}

json memory_needs_json(const std::vector<LengthNeed>& needs) {
  json out = json::array();
  for (const LengthNeed& n : needs) {
    out.push_back({{"length", n.length}, {"sp_size", n.sp_size}, {"recompute_layers", n.recompute_layers},
                   {"predicted_bytes", n.bytes}});
  }
  return out;
}

// The corpus of data.*, with what it kept and skipped (by reason, with examples) logged.
Corpus load_corpus(const DataConfig& data) {
  Corpus corpus = Corpus::load(data);
  spdlog::info("corpus {}: {} documents kept, {} train samples, {} held-out samples, {} documents skipped",
               data.path, corpus.num_documents(), corpus.train_ids().size(), corpus.heldout_ids().size(),
               corpus.skipped().total());
  for (const auto& [reason, n] : corpus.skipped().by_reason) {
    std::string examples;
    for (const auto& e : corpus.skipped().examples.at(reason)) examples += " " + e;
    spdlog::warn("skipped {} document(s) as {}: e.g.{}", n, reason, examples);
  }
  return corpus;
}

TrainState fresh_state(const fs::path& ckpt_dir, const Corpus& corpus) {
  if (fs::exists(ckpt_dir)) {
    spdlog::warn("{} exists; this run starts fresh and replaces it (--resume continues it)", ckpt_dir.string());
  }
  TrainState s;
  s.data_fingerprint = corpus_fingerprint(corpus);
  return s;
}

// A resumed position must lie in its epoch's plans (state.json's own checks cannot know their number).
void check_position(const TrainState& s, size_t epoch_steps, const fs::path& ckpt_dir) {
  if (s.index_in_epoch > static_cast<int64_t>(epoch_steps)) {
    throw std::runtime_error(fmt::format("checkpoint {}: index_in_epoch {} is beyond the {} steps of epoch {} (a "
                                         "checkpoint of another corpus or config?)",
                                         ckpt_dir.string(), s.index_in_epoch, epoch_steps, s.epoch));
  }
}

// Loads run_dir/checkpoint (or the .old a crash left) and checks that the corpus is the one it was trained on.
TrainState resume_from(const fs::path& dir, const Config& cfg, Transformer& model, torch::optim::Optimizer& optimizer,
                       const std::string& fingerprint, bool allow_data_change) {
  check_resumable(dir.string(), cfg);
  const std::string folder = checkpoint_folder(dir.string());
  if (folder != dir.string()) {
    spdlog::warn("{} is missing (a crash between the renames of a save); resuming from {}", dir.string(), folder);
  }
  TrainState s = load_checkpoint(dir.string(), model, &optimizer);
  if (s.data_fingerprint.empty()) {
    spdlog::warn("checkpoint {} records no data fingerprint (an older dcp wrote it): a changed corpus under "
                 "data.path cannot be detected",
                 folder);
  } else if (s.data_fingerprint != fingerprint) {
    const std::string change = fmt::format("the corpus under data.path '{}' changed since checkpoint {} was written "
                                           "({} then, {} now)",
                                           cfg.data.path, folder, s.data_fingerprint, fingerprint);
    if (!allow_data_change) {
      throw std::runtime_error(fmt::format("cannot resume: {}; the data order and the held-out split would differ "
                                           "(--allow-data-change resumes anyway)",
                                           change));
    }
    spdlog::warn("{}; resuming anyway (--allow-data-change): the data order and the held-out split differ", change);
  }
  s.data_fingerprint = fingerprint;
  spdlog::info("resumed from {} at step {} (epoch {}, step {} of the epoch)", folder, s.step, s.epoch,
               s.index_in_epoch);
  return s;
}

// train.cost_model as a file or device name: auto resolves to this machine's cached (or fresh) profile.
std::string resolve_cost_model(const Config& cfg, const ModelShape& shape, int64_t threads,
                               const ProcessGroups& groups) {
  if (cfg.train.cost_model == "h200") {
    spdlog::warn("train.cost_model h200: this CPU run is planned with an H200's speeds and {:.0f} GB; its "
                 "predictions and memory budget do not describe this machine (auto profiles it)",
                 DeviceSpec{}.memory_bytes / 1e9);
  }
  if (cfg.train.cost_model != "auto") return cfg.train.cost_model;
  const DistEnv& env = groups.env();
  if (const int64_t shortest = min_profile_max_length(cfg, env.world_size); cfg.data.max_seq_len < shortest) {
    throw ConfigError(fmt::format("train.cost_model auto: data.max_seq_len {} is below {}, the shortest the "
                                  "profile's grids can be built from with its SP sizes; raise it or give "
                                  "train.cost_model a profile file",
                                  cfg.data.max_seq_len, shortest));
  }
  const json key = profile_cache_key(cfg, shape, threads, env);
  Config profiled = cfg;
  profiled.train.threads = threads;
  const CachedProfile c = resolve_cached_profile(cfg, shape, key, groups.world(), [&] {
    return profile_model(profiled, &groups);
  });
  if (c.profiled) {
    spdlog::info("train.cost_model auto: profiled this model in {:.1f} s; cached at {}", c.seconds, c.path);
  } else {
    spdlog::info("train.cost_model auto: cached profile {} (train.profile_dir; delete it to re-profile)", c.path);
  }
  return c.path;
}

// A budget below what the model holds before any token (weights, gradients, AdamW moments) admits nothing.
void check_resident_bytes(const MemoryModel& memory) {
  const double resident = memory.coefficients().base_bytes;
  if (memory.budget_bytes() <= resident) {
    throw ConfigError(fmt::format(
        "memory.budget_bytes {:.0f} is below the model's resident bytes {:.0f} (weights, gradients and AdamW "
        "moments, {} memory model): no micro-batch can fit; allow at least {:.0f} bytes plus its activations",
        memory.budget_bytes(), resident, memory.source(), resident));
  }
}

}  // namespace

void train(const Config& cfg, const ProcessGroups& groups, const TrainOptions& options) {
  const auto wall_start = std::chrono::steady_clock::now();
  const DistEnv& env = groups.env();
  const Communicator& world = groups.world();
  const bool lead = env.rank == 0;
  const bool resume = options.resume;
  const std::vector<StepPlan>& file_plans = options.plans;
  const fs::path run_dir = cfg.run.dir;
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  if (ec) throw std::runtime_error(fmt::format("cannot create run.dir '{}': {}", run_dir.string(), ec.message()));
  const auto run_lock = lock_run_dir(run_dir.string(), world);
  init_logging(run_dir.string(), env.rank, cfg.run.log_level, resume ? "dcp train --resume" : "dcp train");
  check_same_config(cfg, world);

  const int64_t threads = threads_per_rank(cfg.train, env);
  torch::set_num_threads(static_cast<int>(threads));
  spdlog::info("world_size {} ({} variables), {} threads per rank, process groups ready in {:.2f} s", env.world_size,
               env.launcher, threads, groups.creation_seconds());

  const Corpus corpus = load_corpus(cfg.data);
  std::vector<int64_t> train_lengths;
  for (int64_t id : corpus.train_ids()) train_lengths.push_back(corpus.samples()[static_cast<size_t>(id)].length);
  const LengthHistogram lengths = length_histogram(train_lengths);
  spdlog::info("train sample lengths (tokens): {}", lengths.describe());

  const PrecisionChoice precision = resolve_precision(cfg.train.precision);
  const ModelShape shape = model_shape_of(cfg, activation_bytes(precision.precision));
  const std::string cost_model = resolve_cost_model(cfg, shape, threads, groups);
  torch::manual_seed(static_cast<uint64_t>(cfg.run.seed));
  Transformer model(cfg.model, cfg.attention, precision.precision);
  auto optimizer = make_optimizer(model, cfg.train);
  int64_t n_params = 0;
  for (const auto& p : model->parameters()) n_params += p.numel();
  spdlog::info("model: {} parameters, d_model {}, {} layers, {} heads, d_ff {}", n_params, cfg.model.d_model,
               cfg.model.n_layers, cfg.model.n_heads, cfg.model.d_ff);
  spdlog::info("precision: {}; fp32 master weights, gradients and AdamW moments", precision.describe());

  const fs::path ckpt_dir = run_dir / "checkpoint";
  TrainState state = resume ? resume_from(ckpt_dir, cfg, model, *optimizer, corpus_fingerprint(corpus),
                                          options.allow_data_change)
                             : fresh_state(ckpt_dir, corpus);
  check_same_weights(model, world);

  // The cost model (a profile of another model or precision is refused), the memory checks and the first
  // epoch's plans before the run_dir's files are touched: a refused run leaves an earlier run's files as they were.
  for (const auto& p : file_plans) p.validate(env.world_size, corpus.samples(), cfg.model.n_layers);
  const DeviceSpec device = DeviceSpec::named(cost_model);
  const CostModel cost(shape, device);
  const MemoryModel memory = memory_model_for(cost_model, shape, device, cfg.memory, lengths.max);
  check_resident_bytes(memory);
  spdlog::info("memory: per-rank budget {:.1f} MB ({}), {} memory model, peaks measured by the {}",
               memory.budget_bytes() / 1e6,
               cfg.memory.budget_bytes > 0 ? "memory.budget_bytes"
                                           : fmt::format("memory.fraction {} x {:.1f} GB", cfg.memory.fraction,
                                                         device.memory_bytes / 1e9),
               memory.source(), MemoryMeter::install());
  // A ring shards the sequence without sharding heads, so every size of parallel.sp_sizes serves it.
  const SpMode sp_mode = sp_mode_from_name(cfg.parallel.sp_mode);
  const std::vector<int64_t> sp_sizes =
      sp_mode == SpMode::kRing ? resolve_sp_sizes(cfg.parallel.sp_sizes, env.world_size)
                               : usable_sp_sizes(cfg.parallel.sp_sizes, env.world_size, cfg.model.n_heads);
  const std::vector<LengthNeed> needs = memory_needs(memory, sp_sizes, lengths.max);
  spdlog::info("memory: one sample of {}", describe_memory_needs(needs));
  DataParallelOptions dp{env.world_size, cfg.train.global_batch_tokens, cfg.train.micro_batch_tokens,
                         cfg.model.recompute_layers, cfg.parallel.sp_size, sp_mode,
                         sp_mode == SpMode::kUlyssesRing
                             ? ulysses_ring_size(cfg.parallel.sp_size, cfg.parallel.ulysses_size, cfg.model.n_heads)
                             : 0};
  int64_t static_max_sample_tokens = std::numeric_limits<int64_t>::max();  // static: longer samples skipped
  if (cfg.train.planner == "static" && cfg.parallel.sp_size == 0) {
    const StaticSizing sizing = size_static_planner(dp, memory, sp_sizes, train_lengths);
    dp = sizing.options;
    static_max_sample_tokens = sizing.max_sample_tokens;
    spdlog::info("static planner sized to the longest sample that fits ({} tokens of the longest {}): sp {}, {} "
                 "recomputed layers, micro-batches of up to {} tokens per rank",
                 sizing.longest.length, lengths.max, dp.sp_size, dp.recompute_layers, dp.micro_batch_tokens);
  }

  std::map<std::string, int64_t> planner_skips;
  auto plans_for = [&](int64_t epoch) {
    if (!file_plans.empty()) return file_plans;
    PlanSet set;
    if (cfg.train.planner == "static") {
      std::vector<int64_t> kept;
      for (int64_t id : epoch_order(corpus.train_ids(), static_cast<uint64_t>(cfg.run.seed), epoch)) {
        const bool fits = corpus.samples()[static_cast<size_t>(id)].length <= static_max_sample_tokens;
        (fits ? kept : set.skipped_ids).push_back(id);
      }
      set.steps = plan_data_parallel(corpus.samples(), kept, epoch, dp);
    } else {
      PlannerOptions opt;
      opt.seed = static_cast<uint64_t>(cfg.run.seed);
      opt.tokens_per_step = cfg.train.global_batch_tokens;
      set = plan_training_epoch(cfg.train.planner, corpus.samples(), corpus.train_ids(), epoch, env.world_size,
                                cost, memory, opt);
    }
    if (!set.skipped_ids.empty()) {
      const Sample& example = corpus.samples()[static_cast<size_t>(set.skipped_ids[0])];
      spdlog::warn("planner {} skips {} sample(s) of epoch {}: longer than the memory budget admits at any SP size "
                   "with every layer recomputed (e.g. {}, {} tokens)",
                   cfg.train.planner, set.skipped_ids.size(), epoch, example.source, example.length);
      planner_skips["exceeds_memory_budget"] += static_cast<int64_t>(set.skipped_ids.size());
    }
    return set.steps;
  };
  std::vector<StepPlan> plans = plans_for(state.epoch);
  check_position(state, plans.size(), ckpt_dir);

  const fs::path metrics_path = run_dir / "metrics.jsonl";
  if (lead) {
    write_file_atomically(run_dir / "config.yaml", cfg.to_yaml());
    truncate_metrics(metrics_path, resume ? state.step : 0);
  }
  if (corpus.heldout_ids().empty()) {
    spdlog::warn("no held-out samples (data.heldout_fraction={}): held-out evaluation skipped, reported as null",
                 cfg.data.heldout_fraction);
  }
  if (!resume) {
    state.heldout_bits_per_byte_initial = heldout_bits_per_byte(model, corpus, cfg, groups);
    spdlog::info("held-out bits per byte before training: {:.4f}", state.heldout_bits_per_byte_initial);
  }

  const auto train_start = std::chrono::steady_clock::now();
  const int64_t first_step = state.step;
  Progress progress(cfg.train.max_steps, first_step, lead);
  StepGuard guard(cfg.train, state.nonfinite_skips);
  std::string last_checkpoint = resume ? fmt::format("{} (step {})", ckpt_dir.string(), state.step) : "";
  RunRecord record(corpus.samples(), env.world_size, cost, memory, file_plans.empty() ? cfg.train.planner : "plan-file");
  while (state.step < cfg.train.max_steps &&
         (cfg.train.stop_after_steps == 0 || state.step - first_step < cfg.train.stop_after_steps)) {
    if (state.index_in_epoch >= static_cast<int64_t>(plans.size())) {
      ++state.epoch;
      state.index_in_epoch = 0;
      plans = plans_for(state.epoch);
      spdlog::info("epoch {} begins ({} steps)", state.epoch, plans.size());
    }
    const StepPlan& plan = plans[static_cast<size_t>(state.index_in_epoch)];
    const auto step_start = std::chrono::steady_clock::now();
    StepStats r = compute_step_gradients(model, corpus, plan, groups);
    // The norm before clipping, also without clipping: the guard needs it.
    const double grad_norm = torch::nn::utils::clip_grad_norm_(
        model->parameters(),
        cfg.train.grad_clip > 0 ? cfg.train.grad_clip : std::numeric_limits<double>::infinity());
    const bool update = guard.admit(state.step + 1, r.loss, grad_norm, world, last_checkpoint);
    double lr = lr_at(state.step, cfg.train);
    for (auto& g : optimizer->param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
    if (update) optimizer->step();
    double step_time = seconds_since(step_start);

    ++state.step;
    ++state.index_in_epoch;
    if (update) {
      state.tokens_trained += r.tokens;
      state.samples_trained += r.samples;
    }
    state.nonfinite_skips = guard.skips();
    json line = record.step(plan, r, step_time, lr, grad_norm, state);
    if (!update) line["update_skipped_nonfinite"] = true;
    if (lead) append_line_checked(metrics_path, line.dump());
    progress.update(state.step, r.loss, line["tokens_per_s"].get<double>(), lr);
    throw_if_logging_failed();
    if (cfg.train.checkpoint_every > 0 && state.step % cfg.train.checkpoint_every == 0 &&
        state.step < cfg.train.max_steps) {
      if (lead) {
        TrainState snapshot = state;
        snapshot.wall_time_s += seconds_since(wall_start);
        save_checkpoint(ckpt_dir.string(), model, *optimizer, snapshot, cfg);
      }
      world.barrier();
      last_checkpoint = fmt::format("{} (step {})", ckpt_dir.string(), state.step);
    }
  }
  progress.finish();
  const double train_time = seconds_since(train_start);

  state.wall_time_s += seconds_since(wall_start);
  if (lead) save_checkpoint(ckpt_dir.string(), model, *optimizer, state, cfg);
  world.barrier();

  double final_bpb = heldout_bits_per_byte(model, corpus, cfg, groups);
  spdlog::info("held-out bits per byte: {:.4f} before training, {:.4f} after {} steps", state.heldout_bits_per_byte_initial,
               final_bpb, state.step);
  if (lead) {
    json summary = {{"heldout_bits_per_byte_initial", state.heldout_bits_per_byte_initial},
                    {"heldout_bits_per_byte_final", final_bpb},
                    {"steps", state.step},
                    {"epochs_started", state.epoch + 1},
                    {"tokens_trained", state.tokens_trained},
                    {"samples_trained", state.samples_trained},
                    {"nonfinite_steps_skipped", state.nonfinite_skips},
                    {"loss_spike_warnings", guard.spikes()},
                    {"samples_skipped", [&] {
                       auto all = corpus.skipped().by_reason;
                       for (const auto& [reason, n] : planner_skips) all[reason] += n;
                       return all;
                     }()},
                    {"precision", precision_name(precision.precision)},
                    {"planner", file_plans.empty() ? cfg.train.planner : "plan-file"},
                    {"cost_model", cfg.train.cost_model},
                    {"cost_model_file", cost_model},
                    {"memory_budget_bytes", memory.budget_bytes()},
                    {"memory_model", memory.source()},
                    {"memory_needs", memory_needs_json(needs)},
                    {"memory_meter", MemoryMeter::method()},
                    {"train_lengths", {{"min", lengths.min}, {"p50", lengths.p50}, {"p90", lengths.p90},
                                       {"max", lengths.max}, {"tokens", lengths.tokens}}},
                    {"documents_skipped", corpus.skipped().total()},
                    {"documents_kept", corpus.num_documents()},
                    {"train_samples_per_epoch", corpus.train_ids().size()},
                    {"heldout_samples", corpus.heldout_ids().size()},
                    {"wall_time_s", state.wall_time_s},
                    {"train_time_s_this_run", train_time},
                    {"world_size", env.world_size},
                    {"process_group_creation_s", groups.creation_seconds()},
                    {"threads_per_rank", threads},
                    {"parameters", n_params}};
    summary.update(record.summary());
    write_file_atomically(run_dir / "summary.json", summary.dump(2) + "\n");
    spdlog::info("wrote {}/summary.json, metrics.jsonl, config.yaml and checkpoint/", run_dir.string());
  }
}

}  // namespace dcp
