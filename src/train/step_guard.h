// The trainer's guard between backward and the optimizer step: a non-finite loss or gradient norm on any rank
// never reaches the weights (train.nonfinite stop | skip), and a loss far above the recent ones is logged.
#pragma once

#include <cstdint>
#include <deque>
#include <string>

#include "dcp/config.h"
#include "dcp/dist.h"

namespace dcp {

class StepGuard {
 public:
  /// `max_skips` and the mode come from train.nonfinite and train.nonfinite_max_skips; `skips_so_far` are the
  /// earlier invocations' (TrainState::nonfinite_skips).
  StepGuard(const TrainConfig& cfg, int64_t skips_so_far);

  /// Whether step `step` (1-based) may update the weights: every rank learns whether any rank's `loss` (nats)
  /// or `grad_norm` (L2) is non-finite (one allreduce of a flag), and all answer alike. True: finite, apply.
  /// False: non-finite under train.nonfinite skip, the caller drops the update (counted in skips()). Throws
  /// std::runtime_error naming the step, the values and `last_checkpoint` (what a restart resumes from) under
  /// stop, or when a skip would exceed train.nonfinite_max_skips. Warns (spdlog) when a finite loss is above
  /// 3x the median of the last (up to) 20 finite ones, from the sixth step on.
  bool admit(int64_t step, double loss, double grad_norm, const Communicator& world,
             const std::string& last_checkpoint);

  int64_t skips() const { return skips_; }    ///< over all invocations
  int64_t spikes() const { return spikes_; }  ///< loss-spike warnings of this invocation

 private:
  std::string mode_;
  int64_t max_skips_;
  int64_t skips_;
  int64_t spikes_ = 0;
  std::deque<double> recent_;  // the last kWindow finite losses
};

}  // namespace dcp
