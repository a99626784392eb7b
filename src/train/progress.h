// Training progress on rank 0: a redrawn bar on a terminal, plain lines otherwise (logs, CI).
#pragma once

#include <chrono>
#include <cstdint>

namespace dcp {

class Progress {
 public:
  /// `enabled` false prints nothing (ranks other than 0); `first_step` is where a resumed run starts.
  Progress(int64_t total_steps, int64_t first_step, bool enabled);
  void update(int64_t step, double loss, double tokens_per_s, double lr);
  void finish();

 private:
  int64_t total_, first_;
  bool enabled_, tty_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace dcp
