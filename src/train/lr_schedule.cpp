#include <cmath>

#include "dcp/trainer.h"

namespace dcp {

double lr_at(int64_t step, const TrainConfig& cfg) {
  if (step < cfg.warmup_steps) return cfg.lr * static_cast<double>(step + 1) / static_cast<double>(cfg.warmup_steps);
  double min_lr = cfg.lr * cfg.min_lr_ratio;
  int64_t decay_steps = cfg.max_steps - cfg.warmup_steps;
  if (decay_steps <= 0) return cfg.lr;
  double progress = std::min(1.0, static_cast<double>(step - cfg.warmup_steps) / static_cast<double>(decay_steps));
  return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace dcp
