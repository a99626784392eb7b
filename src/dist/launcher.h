// `dcp launch`: start this node's ranks with torchrun-style variables and take all of them down if one fails;
// with --max-restarts, restart the whole job (every node) from its last good checkpoint instead.
#pragma once

#include <string>
#include <vector>

namespace dcp {

struct LaunchOptions {
  int nproc = 1;                     ///< ranks on this node
  int nnodes = 1;                    ///< nodes of the job, each running its own `dcp launch`
  int node_rank = 0;                 ///< this node, in [0, nnodes): its ranks are node_rank*nproc + [0, nproc)
  std::string master_addr;           ///< host of rank 0's store; empty: 127.0.0.1 (single node only)
  int master_port = 0;               ///< its port; 0: a free port on 127.0.0.1 (single node only)
  std::vector<std::string> command;  ///< a dcp subcommand and its arguments, or a program path (contains '/')
  double grace_s = 10.0;             ///< seconds between SIGTERM and SIGKILL for the survivors of a failure
  int max_restarts = 0;              ///< restarts of the job after failures (0: the first failure ends it)
  double restart_backoff_s = 1.0;    ///< seconds between a failure and the restart
  double join_timeout_s = 600.0;     ///< with restarts: how long the launchers wait for each other at each rendezvous round
};

/// Runs this node's ranks, each in its own process group, and waits. When a rank exits non-zero or by a
/// signal (or the launcher gets SIGINT/SIGTERM/SIGHUP), the process groups of all ranks get SIGTERM (and SIGCONT,
/// so that a stopped rank takes it), then SIGKILL after grace_s, so a rank's own children go too. A launcher
/// killed with SIGKILL leaves a small watcher process that SIGKILLs the groups. With max_restarts > 0 the job is
/// elastic (launch_elastic). Returns 0 when every rank succeeded, else the first failing rank's exit code
/// (128 + signal for a signal). Throws std::invalid_argument for inconsistent options (naming the option),
/// std::runtime_error when no free port or process can be had.
int launch_local(const LaunchOptions& opt);

/// Throws std::invalid_argument naming the option and its value when `opt` is inconsistent: --node-rank
/// outside [0, --nnodes), --nnodes > 1 without --master-addr or --master-port, a --master-addr that does not
/// resolve, no command, a negative --max-restarts or a bad --restart-backoff-s / --join-timeout-s.
void validate_launch_options(const LaunchOptions& opt);

}  // namespace dcp
