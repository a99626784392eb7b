// The trainer's set-up phase: run dir, logs, config check, threads, corpus, precision (include/dcp/trainer.h).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <filesystem>

#include "dcp/trainer.h"
#include "runtime/optimizer.h"
#include "train/run_dir_lock.h"
#include "util/logging.h"

namespace dcp {
namespace {

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

}  // namespace

TrainSetup open_training(const Config& cfg, const ProcessGroups& groups, bool resume) {
  TrainSetup s;
  s.started = std::chrono::steady_clock::now();
  const DistEnv& env = groups.env();
  s.run_dir = cfg.run.dir;
  std::error_code ec;
  std::filesystem::create_directories(s.run_dir, ec);
  if (ec) throw std::runtime_error(fmt::format("cannot create run.dir '{}': {}", s.run_dir, ec.message()));
  s.run_lock = lock_run_dir(s.run_dir, groups.world());
  init_logging(s.run_dir, env.rank, cfg.run.log_level, resume ? "dcp train --resume" : "dcp train");
  if (s.run_lock) {
    const auto removed = remove_leftover_temp_files(s.run_dir);
    if (!removed.empty()) {
      spdlog::warn("removed {} temporary file(s) left in {} by an interrupted run: {}", removed.size(), s.run_dir,
                   fmt::join(removed, ", "));
    }
  }
  if (env.restart_count > 0) {
    spdlog::warn("restart {} of this job by dcp launch --max-restarts: {}", env.restart_count,
                 resume ? "resuming from the last good checkpoint"
                        : "starting from scratch (no checkpoint was written before the failure)");
  }
  check_same_config(cfg, groups.world());

  s.threads = threads_per_rank(cfg.train, env);
  torch::set_num_threads(static_cast<int>(s.threads));
  spdlog::info("world_size {} ({} variables), {} threads per rank, process groups ready in {:.2f} s", env.world_size,
               env.launcher, s.threads, groups.creation_seconds());

  s.corpus = load_corpus(cfg.data);
  for (int64_t id : s.corpus.train_ids()) s.train_lengths.push_back(s.corpus.samples()[static_cast<size_t>(id)].length);
  s.lengths = length_histogram(s.train_lengths);
  spdlog::info("train sample lengths (tokens): {}", s.lengths.describe());

  s.precision = resolve_precision(cfg.train.precision);
  s.shape = model_shape_of(cfg, activation_bytes(s.precision.precision));
  return s;
}

}  // namespace dcp
