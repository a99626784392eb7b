#include "train/run_dir_lock.h"

#include <fmt/format.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <mutex>
#include <stdexcept>

namespace dcp {

std::shared_ptr<FileLock> lock_run_dir(const std::string& run_dir, const Communicator& world) {
  static std::mutex mutex;
  static std::map<std::string, std::weak_ptr<FileLock>> held;  // a second flock in this process would fail
  std::shared_ptr<FileLock> lock;
  std::string refusal;
  if (world.rank() == 0) {
    const std::string path = (std::filesystem::weakly_canonical(run_dir) / "run.lock").string();
    std::lock_guard<std::mutex> guard(mutex);
    lock = held[path].lock();
    if (!lock) {
      try {
        auto fresh = std::make_shared<FileLock>(path);
        if (fresh->try_lock()) {
          char host[256] = "?";
          gethostname(host, sizeof(host) - 1);
          fresh->set_holder_note(fmt::format("pid {} on host {}\n", getpid(), host));
          held[path] = lock = fresh;
        } else {
          const std::string note = fresh->holder_note();
          refusal = fmt::format("run.dir '{}' is in use by another dcp run ({}): wait for it to end or use another "
                                "run.dir",
                                run_dir, note.empty() ? "its lock file names no process" : note);
        }
      } catch (const std::exception& e) {
        refusal = e.what();
      }
    }
  }
  auto failed = torch::tensor({refusal.empty() ? 0.0 : 1.0}, torch::kFloat64);
  world.allreduce_max(failed);
  if (failed.item<double>() != 0) {
    throw std::runtime_error(refusal.empty() ? fmt::format("run.dir '{}' is in use by another dcp run (see rank 0)",
                                                           run_dir)
                                             : refusal);
  }
  return lock;
}

std::vector<std::string> remove_leftover_temp_files(const std::string& run_dir) {
  // write_file_atomically's "<name>.<tag><pid>.tmp" of the run dir's own files (metrics.jsonl, summary.json,
  // config.yaml): a kill during the rewrite leaves one behind. The run dir is locked, so none is in use.
  std::vector<std::string> removed;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(run_dir, ec)) {
    const std::string name = entry.path().filename().string();
    for (const char* base : {"metrics.jsonl.", "summary.json.", "config.yaml."}) {
      const std::string b = base;
      if (name.size() <= b.size() + 4 || name.rfind(b, 0) != 0 || name.substr(name.size() - 4) != ".tmp") continue;
      const std::string middle = name.substr(b.size(), name.size() - b.size() - 4);
      if (middle.empty() || middle.find_first_not_of("0123456789") != std::string::npos) continue;
      std::error_code rm;
      if (entry.is_regular_file(rm) && std::filesystem::remove(entry.path(), rm)) removed.push_back(name);
    }
  }
  std::sort(removed.begin(), removed.end());
  return removed;
}

}  // namespace dcp
