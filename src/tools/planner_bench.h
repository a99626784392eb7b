// `dcp bench`: the same samples trained with several planners on real local processes, side by side.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dcp/config.h"

namespace dcp {

/// One `dcp bench` run, its options checked by the command (src/cli/cmd_bench.cpp).
struct PlannerBench {
  std::string config_path;              ///< --config of every run ("" = the defaults)
  int nproc = 2;                        ///< ranks of every run
  std::vector<std::string> planners;    ///< in the order they take turns (the first rotates every slice)
  std::vector<std::string> overrides;   ///< --section.key=value of every run, as given
  std::string out_dir = "runs/bench";   ///< the runs: out_dir/<planner>/
  std::string report;                   ///< path prefix of the .md, .csv and .png results
  int64_t slices = 3;                   ///< time slices per planner
  int64_t slice_steps = 1;              ///< steps per slice (the last may have fewer)
  double grace_s = 10.0;                ///< dcp launch --grace of every slice
  bool plot = true;                     ///< draw the PNG with gnuplot
};

/// Runs the slices (each `dcp launch --nproc N -- train ... --train.planner=P --train.stop_after_steps=S
/// [--resume]` with its log in out_dir/<planner>/bench_slice<k>.log), printing a line per slice, then reads every
/// run (metrics.jsonl, summary.json), writes <report>.csv, <report>.md (the command, the machine, the table, the
/// repetitions, the prediction errors, held-out bits per byte) and <report>.png, and prints the table. `cfg` is
/// the runs' resolved config (train.max_steps, seed and shape for the report). Returns 0, or the exit code of the
/// first slice that failed with `failure` (when non-null) naming the planner, the slice, the command and its log.
/// Throws std::runtime_error when a run's files cannot be read or a result cannot be written, and what gnuplot's
/// run throws.
int run_planner_bench(const PlannerBench& bench, const Config& cfg, std::string* failure);

}  // namespace dcp
