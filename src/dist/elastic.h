// `dcp launch --max-restarts N`: an elastic job, as torchelastic's agent runs one. The launcher of node 0 serves
// a c10d TCPStore on --master-port; every launcher meets the others there in rendezvous rounds, and every rank of rendezvous round R is
// a client of it under the keys "dcp/r<R>/" (DistEnv::agent_store). Protocol (keys under "dcp/launch/"):
//   round                  the newest rendezvous round opened (node 0 opens it; a launcher that knows a newer one raises it)
//   <R>/join/<k>           node k is ready for rendezvous round R;       <R>/start     node 0 saw all nodes: {resume, step}
//   <R>/first, <R>/failed  the first failure of rendezvous round R, and that there is one (every launcher polls it)
//   <R>/status/<k>         node k's ranks all exited: {ok, failure}
//   <R>/decision           node 0's verdict over all statuses: done, restart or give_up (with the exit code)
//   <R>/ack/<k>            node k read it (node 0 keeps the store up until all did, or 10 s)
//   checkpoint_step        the newest checkpoint step rank 0 wrote in this job (ProcessGroups::report_checkpoint)
// A launcher that comes back (restarted by a scheduler after kill -9) joins the next rendezvous round; one whose store died
// (node 0's launcher killed and restarted) connects to the new one and raises `round` and `checkpoint_step` to
// what it knew, so that the count of restarts and the resume go on.
#pragma once

#include "dist/launcher.h"

namespace dcp {

/// Runs rendezvous rounds of this node's ranks until one succeeds on every node (returns 0), a failure is not worth a
/// restart (a usage error, exit 2; a refused checkpoint; a second non-finite-loss stop; a signal to a launcher) or
/// opt.max_restarts restarts are used up: then returns the failing rank's exit code, after printing the failure
/// and its message. Each restart is printed (which rank, which signal or exit code, which checkpoint step, or that
/// it restarts from scratch), `--resume` is added to a `train` command once this job has written a checkpoint, and
/// the ranks get DCP_RESTART_COUNT (summary.json's `restarts`). Throws std::runtime_error when node 0 cannot serve
/// the store (the port is in use: at once).
int launch_elastic(const LaunchOptions& opt);

/// A port free on 127.0.0.1 now (a single-node job's store).
int free_loopback_port();

}  // namespace dcp
