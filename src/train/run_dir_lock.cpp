#include "train/run_dir_lock.h"

#include <fmt/format.h>
#include <torch/torch.h>
#include <unistd.h>

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

}  // namespace dcp
