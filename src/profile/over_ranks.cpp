#include "profile/over_ranks.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace dcp {

OverRanks over_ranks(const Communicator& world, const std::vector<double>& values) {
  for (double v : values) {
    if (!(v >= 0) || !std::isfinite(v)) {
      throw std::invalid_argument(fmt::format("over_ranks: value {} must be finite and >= 0", v));
    }
  }
  const int64_t ranks = world.size(), n = static_cast<int64_t>(values.size());
  at::Tensor rows = at::zeros({ranks, n}, at::kDouble);
  std::copy(values.begin(), values.end(), rows[world.rank()].data_ptr<double>());
  world.allreduce_max(rows);
  OverRanks out{std::vector<double>(values.size(), 0.0), std::vector<double>(values.size(), 0.0)};
  const double* all = rows.data_ptr<double>();
  for (int64_t r = 0; r < ranks; ++r) {
    for (int64_t i = 0; i < n; ++i) {
      out.mean[i] += all[r * n + i];
      out.max[i] = std::max(out.max[i], all[r * n + i]);
    }
  }
  for (double& m : out.mean) m /= static_cast<double>(ranks);
  return out;
}

}  // namespace dcp
