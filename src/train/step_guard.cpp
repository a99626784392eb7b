#include "train/step_guard.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "util/error_message.h"

namespace dcp {
namespace {

constexpr size_t kWindow = 20;
constexpr size_t kMinHistory = 5;  // a spike in the first steps is worth a warning too
constexpr double kSpikeRatio = 3.0;

}  // namespace

StepGuard::StepGuard(const TrainConfig& cfg, int64_t skips_so_far)
    : mode_(cfg.nonfinite), max_skips_(cfg.nonfinite_max_skips), skips_(skips_so_far) {}

bool StepGuard::admit(int64_t step, double loss, double grad_norm, const Communicator& world,
                      const std::string& last_checkpoint) {
  // The loss and the reduced gradients agree on every rank today; the flag keeps all ranks in step even where a
  // rank-local value (one that no collective touched) went bad.
  auto flag = torch::tensor({std::isfinite(loss) && std::isfinite(grad_norm) ? 0.0 : 1.0}, torch::kFloat64);
  world.allreduce_max(flag);
  if (flag.item<double>() == 0) {
    if (recent_.size() >= kMinHistory) {
      std::vector<double> sorted(recent_.begin(), recent_.end());
      std::nth_element(sorted.begin(), sorted.begin() + sorted.size() / 2, sorted.end());
      const double median = sorted[sorted.size() / 2];
      if (median > 0 && loss > kSpikeRatio * median) {
        ++spikes_;
        spdlog::warn("step {}: loss {:.4g} is {:.1f}x the median {:.4g} of the last {} steps (a loss spike: too "
                     "high a train.lr, or bad data?)",
                     step, loss, loss / median, median, sorted.size());
      }
    }
    recent_.push_back(loss);
    if (recent_.size() > kWindow) recent_.pop_front();
    return true;
  }
  const std::string what = fmt::format("step {}: the loss is {} and the gradient norm {} on rank {} (or a peer)",
                                       step, loss, grad_norm, world.rank());
  if (mode_ == "skip" && skips_ < max_skips_) {
    ++skips_;
    spdlog::warn("{}: its update is skipped (train.nonfinite skip, {} of at most {})", what, skips_, max_skips_);
    return false;
  }
  throw RunFailure(kFailureNonfinite, fmt::format(
      "{}: stopped before the optimizer step, the weights are unchanged; {}{}", what,
      last_checkpoint.empty() ? "no checkpoint was written yet" : "the last good checkpoint is " + last_checkpoint,
      mode_ == "skip" ? fmt::format(" (train.nonfinite skip: {} steps skipped already, train.nonfinite_max_skips {})",
                                    skips_, max_skips_)
                      : " (train.nonfinite skip drops such steps instead)"));
}

}  // namespace dcp
