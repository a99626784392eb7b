#include "tools/matmul_peak.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <chrono>
#include <stdexcept>
#include <vector>

#include "util/clock.h"
#include "util/stats.h"

namespace dcp {
namespace {

// Median seconds of `repetitions` timed products after one warm-up (oneDNN's kernel selection and the first-touch
// page faults of the output land in the warm-up).
double median_matmul_seconds(int64_t size, int64_t repetitions, torch::ScalarType dtype) {
  const auto a = torch::randn({size, size}).to(dtype);
  const auto b = torch::randn({size, size}).to(dtype);
  torch::NoGradGuard no_grad;
  torch::matmul(a, b);
  std::vector<double> seconds;
  for (int64_t run = 0; run < repetitions; ++run) {
    const auto start = std::chrono::steady_clock::now();
    const auto c = torch::matmul(a, b);
    seconds.push_back(seconds_since(start));
  }
  return median(seconds);
}

}  // namespace

MatmulPeak measure_matmul_peak(int64_t size, int64_t repetitions) {
  if (size < 1) throw std::invalid_argument(fmt::format("measure_matmul_peak: size {} must be >= 1", size));
  if (repetitions < 1) {
    throw std::invalid_argument(fmt::format("measure_matmul_peak: repetitions {} must be >= 1", repetitions));
  }
  const double n = static_cast<double>(size);
  const double flops = 2 * n * n * n;
  MatmulPeak peak;
  peak.size = size;
  peak.threads = at::get_num_threads();
  peak.runs = repetitions;
  peak.fp32_gflops = flops / median_matmul_seconds(size, repetitions, torch::kFloat) / 1e9;
  peak.bf16_gflops = flops / median_matmul_seconds(size, repetitions, torch::kBFloat16) / 1e9;
  return peak;
}

}  // namespace dcp
