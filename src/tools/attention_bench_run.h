// `dcp bench-attention`: one attention layer's forward and backward over sequence lengths, against the measured
// matmul peak, written as markdown, CSV and a PNG.
#pragma once

#include <cstdint>
#include <string>

#include "tools/attention_bench.h"

namespace dcp {

/// One `dcp bench-attention` run, its options checked by the command (src/cli/cmd_bench_attention.cpp).
struct AttentionBenchRun {
  AttentionBenchOptions options;  ///< the points: lengths, variants, dtype, shapes, repetitions, caps
  int64_t threads = 0;            ///< intra-op threads; 0 = every hardware thread
  int64_t matmul_size = 2048;     ///< n of the n^3 product whose rate is the peak
  std::string prefix;             ///< results: <prefix>.md, .csv, .png (the folder exists and is writable)
  std::string note;               ///< appended to the report's machine line
  bool plot = true;               ///< draw the PNG with gnuplot
};

/// Sets the threads, installs the memory meter, measures the matmul peak, then every point (bench_attention),
/// printing a line per point, and writes the CSV, the PNG and the markdown report (the command, the machine, the
/// method, the tables), then prints the tables. Throws std::runtime_error when a result cannot be written, and
/// what bench_attention and gnuplot's run throw.
void run_attention_bench(const AttentionBenchRun& run);

}  // namespace dcp
