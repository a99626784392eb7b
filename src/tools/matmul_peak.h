// The matmul rate this process reaches on this CPU, the yardstick of `dcp bench-attention`'s fraction of peak.
#pragma once

#include <cstdint>

namespace dcp {

/// Measured dense matmul rates of this process, fp32 and bf16.
struct MatmulPeak {
  int64_t size = 0;        ///< n of the n x n x n product a @ b
  int64_t threads = 0;     ///< intra-op threads it ran with
  int64_t runs = 0;        ///< timed runs per dtype behind each median
  double fp32_gflops = 0;  ///< 2 n^3 / median seconds of the fp32 product, GFLOP/s
  double bf16_gflops = 0;  ///< the same for bf16 (oneDNN, AMX where the CPU has it), GFLOP/s
};

/// Times torch::matmul(a, b) on random [size, size] matrices, fp32 then bf16, with torch's current intra-op
/// thread count: one warm-up, then the median of `repetitions` timed runs (std::chrono::steady_clock), each
/// counted as 2 size^3 FLOPs. Throws std::invalid_argument naming the argument when size or repetitions is < 1.
MatmulPeak measure_matmul_peak(int64_t size = 2048, int64_t repetitions = 5);

}  // namespace dcp
