// The trainer's checkpoint phase (src/train/checkpointer.h).
#include "train/checkpointer.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <filesystem>
#include <fstream>

#include "train/data_fingerprint.h"
#include "util/file_write.h"

namespace dcp {
namespace fs = std::filesystem;
using nlohmann::json;

Checkpointer::Checkpointer(const std::string& run_dir, const Config& cfg)
    : dir_((fs::path(run_dir) / "checkpoint").string()),
      cfg_(cfg),
      every_(cfg.train.checkpoint_every),
      max_steps_(cfg.train.max_steps) {}

TrainState Checkpointer::resume(Transformer& model, torch::optim::Optimizer& optimizer, const std::string& fingerprint,
                                bool allow_data_change) const {
  const fs::path dir = dir_;
  const Config& cfg = cfg_;
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

TrainState Checkpointer::fresh(const Corpus& corpus) const {
  const fs::path ckpt_dir = dir_;
  if (fs::exists(ckpt_dir)) {
    spdlog::warn("{} exists; this run starts fresh and replaces it (--resume continues it)", ckpt_dir.string());
  }
  TrainState s;
  s.data_fingerprint = corpus_fingerprint(corpus);
  return s;
}

void Checkpointer::check_position(const TrainState& s, size_t epoch_steps) const {
  const fs::path ckpt_dir = dir_;
  if (s.index_in_epoch > static_cast<int64_t>(epoch_steps)) {
    throw std::runtime_error(fmt::format("checkpoint {}: index_in_epoch {} is beyond the {} steps of epoch {} (a "
                                         "checkpoint of another corpus or config?)",
                                         ckpt_dir.string(), s.index_in_epoch, epoch_steps, s.epoch));
  }
}

bool Checkpointer::due(int64_t step) const { return every_ > 0 && step % every_ == 0 && step < max_steps_; }

void Checkpointer::save(Transformer& model, torch::optim::Optimizer& optimizer, const TrainState& state) const {
  save_checkpoint(dir_, model, optimizer, state, cfg_);
}

std::string Checkpointer::describe(int64_t step) const { return fmt::format("{} (step {})", dir_, step); }

// On resume, lines past the checkpoint belong to steps that will run again. A crash or a full disk can leave a
// partial last line: it is dropped with a warning; a bad line before the last one is someone's edit and refused.
void truncate_metrics(const std::string& file, int64_t keep_through_step) {
  const fs::path path = file;
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

}  // namespace dcp
