// `dcp launch`: start N local ranks with torchrun-style variables and take all of them down if one fails.
#pragma once

#include <string>
#include <vector>

namespace dcp {

struct LaunchOptions {
  int nproc = 1;
  std::vector<std::string> command;  ///< a dcp subcommand and its arguments, or a program path (contains '/')
  double grace_s = 10.0;             ///< seconds between SIGTERM and SIGKILL for the survivors of a failure
};

/// Runs the ranks and waits. When a rank exits non-zero or by a signal (or the launcher gets SIGINT/SIGTERM),
/// the others get SIGTERM, then SIGKILL after grace_s; no process is left running. Returns 0 when every rank
/// succeeded, else the first failing rank's exit code (128 + signal for a signal). Throws std::runtime_error
/// when no free port or process can be had.
int launch_local(const LaunchOptions& opt);

}  // namespace dcp
