#include "train/progress.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "util/clock.h"

namespace dcp {

Progress::Progress(int64_t total_steps, int64_t first_step, bool enabled)
    : total_(total_steps), first_(first_step), enabled_(enabled), tty_(isatty(fileno(stdout)) != 0),
      start_(std::chrono::steady_clock::now()) {}

void Progress::update(int64_t step, double loss, double tokens_per_s, double lr) {
  if (!enabled_) return;
  double elapsed = seconds_since(start_);
  int64_t done = step - first_;
  double eta = done > 0 ? elapsed / static_cast<double>(done) * static_cast<double>(total_ - step) : 0.0;
  std::string stats = fmt::format("step {}/{}  loss {:.4f}  {:.0f} tok/s  lr {:.2e}  elapsed {:.0f}s  eta {:.0f}s",
                                  step, total_, loss, tokens_per_s, lr, elapsed, eta);
  if (tty_) {
    constexpr int kWidth = 30;
    int filled = total_ > 0 ? static_cast<int>(kWidth * step / total_) : kWidth;
    fmt::print("\r[{}{}] {}\033[K", std::string(static_cast<size_t>(filled), '#'),
               std::string(static_cast<size_t>(kWidth - filled), '.'), stats);
    std::fflush(stdout);
  } else {
    // About twenty lines per run keep logs readable.
    int64_t every = std::max<int64_t>(1, total_ / 20);
    if (step % every == 0 || step == total_ || done == 1) {
      fmt::print("{}\n", stats);
      std::fflush(stdout);
    }
  }
}

void Progress::finish() {
  if (enabled_ && tty_) fmt::print("\n");
}

}  // namespace dcp
