// One rendezvous round of `dcp launch`: this node's ranks started, supervised and taken down together (src/dist/launcher.cpp),
// and the failure record the launchers of an elastic job exchange (src/dist/elastic.cpp).
#pragma once

#include <sys/types.h>

#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "dist/launcher.h"

namespace dcp {

/// Why a rendezvous round failed, as the launchers report it to each other.
struct Failure {
  int node = 0;
  int rank = -1;         ///< global rank, -1 when no rank failed (a lost node, a signal to a launcher)
  int code = 1;          ///< the exit code the job ends with: the rank's, 128 + N for signal N
  std::string kind;      ///< usage | checkpoint_refused | nonfinite | runtime | signal | lost_node | launcher_signal
  std::string what;      ///< "rank 1 (node 1, pid 42) was killed by signal 9 (Killed)"
  std::string message;   ///< the rank's own error message (its DCP_ERROR_FILE), "" when it left none

  nlohmann::json to_json() const;
  static Failure from_json(const nlohmann::json& j);
  /// `what`, then ": message" when there is one.
  std::string describe() const;
};

/// The progress of a rendezvous round, as launch_round reports it.
struct RoundResult {
  bool ok = false;                 ///< every rank of this node exited 0
  std::optional<Failure> failure;  ///< this node's first failure (none when stopped for a peer's)
  bool stopped_for_peer = false;   ///< `peer_failed` asked to stop
  int launcher_signal = 0;         ///< SIGINT/SIGTERM/SIGHUP that this launcher got, 0 if none
};

/// Tells the watcher process (start_watcher) which process groups to SIGKILL should this launcher die.
class Watcher {
 public:
  Watcher();  ///< forks the watcher; throws std::runtime_error
  ~Watcher();  ///< ends it (the launcher's own clean-up is done)
  void add(pid_t group);
  void clear();  ///< forget the groups of the last rendezvous round (all reaped)
 private:
  int fd_ = -1;
  pid_t pid_ = -1;
};

/// What a rendezvous round's ranks get besides RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT.
struct RoundSetup {
  std::string addr;
  int port = 0;
  std::vector<std::string> command;                          ///< after "dcp", or a program and its arguments
  std::vector<std::pair<std::string, std::string>> env;      ///< extra variables (DCP_RESTART_COUNT, ...)
  std::string error_file_prefix;                             ///< "" or DCP_ERROR_FILE = prefix + "rank<R>.json"
};

/// Installs the launcher's handlers of SIGINT, SIGTERM and SIGHUP (no SA_RESTART, so sleeps return); returns the
/// last such signal received, 0 if none.
void install_stop_handlers();
int stop_signal();
/// Sleeps `seconds`, waking up early for a stop signal; returns false if one came.
bool sleep_unless_stopped(double seconds);

/// Starts this node's ranks, supervises them and returns once all have exited. A rank that fails (non-zero exit
/// or a signal) or a stop signal to the launcher takes all ranks down (SIGTERM + SIGCONT to their process groups,
/// SIGKILL after opt.grace_s); `on_failure` is called at once with this node's first failure, `peer_failed`
/// every ~250 ms while ranks run and, when it returns true, takes them down the same way.
RoundResult launch_round(const LaunchOptions& opt, const RoundSetup& setup, Watcher& watcher,
                         const std::function<bool()>& peer_failed, const std::function<void(const Failure&)>& on_failure);

}  // namespace dcp
