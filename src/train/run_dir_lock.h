// One run dir, one run: the trainer and distill hold run.dir for the whole invocation, so that two runs cannot
// interleave their metrics, share logs or race on checkpoint.tmp.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "dcp/dist.h"
#include "util/file_lock.h"

namespace dcp {

/// Rank 0 takes an exclusive flock on `run_dir`/run.lock (created, left in place, holding "pid P on host H")
/// and tells every rank of `world` whether it got it (one allreduce). Returns the held lock on rank 0 (release
/// it by dropping the pointer; the kernel releases it when the process dies, also under kill -9) and null on the
/// other ranks. A process that holds the lock already (distill, then the fine-tuning train) gets the same lock
/// again. Throws std::runtime_error on every rank naming the folder and the holder's note when another process
/// holds it, or the lock file's error. `run_dir` must exist. The lock is advisory and needs flock (local
/// folders; NFS only where the client forwards it).
std::shared_ptr<FileLock> lock_run_dir(const std::string& run_dir, const Communicator& world);

/// Removes the temporary files "metrics.jsonl.<pid>.tmp", "summary.json.<pid>.tmp" and "config.yaml.<pid>.tmp"
/// that a run killed while rewriting one of those files left in `run_dir`; returns their names, sorted. Call it
/// holding the run dir's lock (no other run then writes there).
std::vector<std::string> remove_leftover_temp_files(const std::string& run_dir);

}  // namespace dcp
