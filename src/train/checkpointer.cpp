// The trainer's checkpoint phase (src/train/checkpointer.h).
#include "train/checkpointer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <filesystem>
#include <algorithm>
#include <fstream>

#include "train/data_fingerprint.h"
#include "util/error_message.h"
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
                                bool allow_data_change) {
  const Config& cfg = cfg_;
  check_resumable(dir_, cfg);
  TrainState s = load_checkpoint(dir_, model, &optimizer);  // falls back to dir_.old, warning once
  const std::string& folder = s.loaded_from;
  if (folder != dir_) {
    std::error_code ec;
    // The newest folder failed verification (or is missing): the next save must keep dir_.old, the good one.
    replace_newest_ = fs::exists(fs::path(dir_) / "state.json", ec);
  } else {
    saved_step_ = s.step;
  }
  if (s.data_fingerprint.empty()) {
    spdlog::warn("checkpoint {} records no data fingerprint (an older dcp wrote it): a changed corpus under "
                 "data.path cannot be detected",
                 folder);
  } else if (s.data_fingerprint != fingerprint) {
    const std::string change = fmt::format("the corpus under data.path '{}' changed since checkpoint {} was written "
                                           "({} then, {} now)",
                                           cfg.data.path, folder, s.data_fingerprint, fingerprint);
    if (!allow_data_change) {
      throw RunFailure(kFailureCheckpointRefused, fmt::format("cannot resume: {}; the data order and the held-out "
                                                              "split would differ (--allow-data-change resumes anyway)",
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

void Checkpointer::save(Transformer& model, torch::optim::Optimizer& optimizer, const TrainState& state) {
  if (replace_newest_) {
    // Refused at resume: installing the new one must not turn it into dir_.old in place of the good one.
    spdlog::warn("removing the refused checkpoint {} before saving step {} (the previous one, {}.old, stays)", dir_,
                 state.step, dir_);
    std::error_code ec;
    fs::remove_all(dir_, ec);
    if (ec) throw std::runtime_error(fmt::format("cannot remove the refused checkpoint '{}': {}", dir_, ec.message()));
    replace_newest_ = false;
  }
  save_checkpoint(dir_, model, optimizer, state, cfg_);
  saved_step_ = state.step;
  spdlog::info("wrote checkpoint {} (step {})", dir_, state.step);
}

bool Checkpointer::holds(int64_t step) const { return saved_step_ == step; }

std::string Checkpointer::describe(int64_t step) const { return fmt::format("{} (step {})", dir_, step); }

// On resume, lines past the checkpoint belong to steps that will run again. A crash or a full disk can leave a
// partial last line: it is dropped with a warning; a bad line before the last one is someone's edit and refused.
void truncate_metrics(const std::string& file, int64_t keep_through_step) {
  const fs::path path = file;
  std::vector<std::string> lines;
  std::error_code ec;
  const bool exists = fs::exists(path, ec);
  if (keep_through_step > 0) {
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) lines.push_back(line);
  }
  while (!lines.empty() && lines.back().empty()) lines.pop_back();
  std::string text;
  std::vector<int64_t> kept;
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
    const int64_t step = j.value("step", int64_t{0});
    if (step <= keep_through_step) {
      text += lines[i] + "\n";
      kept.push_back(step);
    }
  }
  // The checkpoint's steps 1..keep_through_step each wrote a line before the checkpoint was saved; any that is
  // missing was lost outside this run (a deleted, shortened or restored file): named, and the run goes on.
  if (keep_through_step > 0) {
    std::sort(kept.begin(), kept.end());
    std::vector<std::string> gaps;
    int64_t lost = 0, next = 1;
    auto gap = [&](int64_t from, int64_t to) {
      if (from > to) return;
      lost += to - from + 1;
      gaps.push_back(from == to ? std::to_string(from) : fmt::format("{}..{}", from, to));
    };
    for (int64_t step : kept) {
      if (step < next) continue;
      gap(next, step - 1);
      next = step + 1;
    }
    gap(next, keep_through_step);
    if (!exists) {
      spdlog::warn("metrics '{}' is missing: the lines of steps 1..{} (before the checkpoint) are lost; this run "
                   "appends from step {}",
                   path.string(), keep_through_step, keep_through_step + 1);
    } else if (lost > 0) {
      spdlog::warn("metrics '{}' lacks the lines of {} step(s) before the checkpoint's step {}: {} (shortened or "
                   "edited outside dcp?); this run appends from step {}",
                   path.string(), lost, keep_through_step, fmt::join(gaps, ", "), keep_through_step + 1);
    }
  }
  // Through a new file and a rename: a crash or a full disk during the rewrite leaves the old file whole.
  write_file_atomically(path, text);
}

}  // namespace dcp
