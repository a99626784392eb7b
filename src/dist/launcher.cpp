#include "dist/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netdb.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <stdexcept>
#include <thread>
#include <vector>

namespace dcp {
namespace {

volatile sig_atomic_t g_stop_signal = 0;
void on_signal(int sig) { g_stop_signal = sig; }

// A port free on `addr` (a numeric IPv4 address) at the time of the call.
int free_port(in_addr_t addr) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(fmt::format("socket() failed: {}", std::strerror(errno)));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = addr;
  sa.sin_port = 0;
  socklen_t len = sizeof(sa);
  if (bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) {
    int err = errno;
    close(fd);
    throw std::runtime_error(fmt::format("no free port for the rendezvous: {}", std::strerror(err)));
  }
  close(fd);
  return ntohs(sa.sin_port);
}

[[noreturn]] void exec_rank(const LaunchOptions& opt, int local_rank, const std::string& addr, int port,
                            pid_t launcher) {
  // Its own process group, so that signalling the group reaches the rank's children too (a shell's background
  // jobs, a program the rank starts); the launcher signals -pgid.
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);  // a launcher killed with SIGKILL must not leave ranks behind
  if (getppid() != launcher) _exit(1);  // it died before prctl took effect
  setenv("RANK", std::to_string(opt.node_rank * opt.nproc + local_rank).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(local_rank).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(opt.nnodes * opt.nproc).c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", std::to_string(opt.nproc).c_str(), 1);
  setenv("MASTER_ADDR", addr.c_str(), 1);
  setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  bool is_program = opt.command[0].find('/') != std::string::npos;
  std::vector<std::string> args;
  if (!is_program) args.push_back("dcp");
  args.insert(args.end(), opt.command.begin(), opt.command.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  execv(is_program ? opt.command[0].c_str() : "/proc/self/exe", argv.data());
  fmt::print(stderr, "dcp launch: cannot start rank {} ({}): {}\n", local_rank, args[0], std::strerror(errno));
  _exit(127);
}

// The watcher: SIGKILL reaches the launcher with no chance to clean up, and PDEATHSIG reaches only the ranks
// themselves, not their children. This child of the launcher reads the ranks' process-group ids from a pipe;
// when the pipe closes without the end mark (0), the launcher died, and it SIGKILLs those groups.
// Only async-signal-safe calls after fork(): verify-plan calls launch_local from a process with threads.
constexpr int kMaxRanks = 1024;
pid_t start_watcher(int* write_fd) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error(fmt::format("pipe() failed: {}", std::strerror(errno)));
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error(fmt::format("fork failed for the watcher: {}", std::strerror(errno)));
  if (pid == 0) {
    close(fds[1]);
    setpgid(0, 0);  // a SIGKILL to the launcher's whole process group must not take the watcher along
    // The launcher handles these and then ends the watcher itself; if they kill the launcher, EOF follows.
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    static int32_t groups[kMaxRanks];
    int n = 0;
    int32_t g = 0;
    while (read(fds[0], &g, sizeof(g)) == static_cast<ssize_t>(sizeof(g))) {
      if (g == 0) _exit(0);  // the launcher finished its own clean-up
      if (n < kMaxRanks) groups[n++] = g;
    }
    for (int i = 0; i < n; ++i) kill(-groups[i], SIGKILL);
    _exit(0);
  }
  close(fds[0]);
  *write_fd = fds[1];
  return pid;
}

void tell_watcher(int fd, int32_t value) {
  if (write(fd, &value, sizeof(value)) != static_cast<ssize_t>(sizeof(value))) {
    fmt::print(stderr, "dcp launch: cannot reach the watcher process: {}\n", std::strerror(errno));
  }
}

std::string describe(const siginfo_t& si) {
  if (si.si_code == CLD_EXITED) return fmt::format("exited with code {}", si.si_status);
  return fmt::format("was killed by signal {} ({})", si.si_status, strsignal(si.si_status));
}

int exit_code(const siginfo_t& si) { return si.si_code == CLD_EXITED ? si.si_status : 128 + si.si_status; }

}  // namespace

void validate_launch_options(const LaunchOptions& opt) {
  if (opt.nproc < 1) throw std::invalid_argument(fmt::format("--nproc {}: must be >= 1", opt.nproc));
  if (opt.nnodes < 1) throw std::invalid_argument(fmt::format("--nnodes {}: must be >= 1", opt.nnodes));
  if (static_cast<int64_t>(opt.nproc) * opt.nnodes > 1 << 20) {
    throw std::invalid_argument(
        fmt::format("--nnodes {} x --nproc {}: more than {} ranks", opt.nnodes, opt.nproc, 1 << 20));
  }
  if (opt.nproc > kMaxRanks) {
    throw std::invalid_argument(fmt::format("--nproc {}: at most {} ranks per node", opt.nproc, kMaxRanks));
  }
  if (opt.node_rank < 0 || opt.node_rank >= opt.nnodes) {
    throw std::invalid_argument(
        fmt::format("--node-rank {}: must be in [0, {}) for --nnodes {}", opt.node_rank, opt.nnodes, opt.nnodes));
  }
  if (opt.master_port < 0 || opt.master_port > 65535) {
    throw std::invalid_argument(fmt::format("--master-port {}: not a port number (1-65535)", opt.master_port));
  }
  if (opt.nnodes > 1 && opt.master_addr.empty()) {
    throw std::invalid_argument(fmt::format(
        "--master-addr: required with --nnodes {} (the host of node 0, as every node reaches it)", opt.nnodes));
  }
  if (opt.nnodes > 1 && opt.master_port == 0) {
    throw std::invalid_argument(fmt::format(
        "--master-port: required with --nnodes {} (the same free port on the --master-addr host for every node)",
        opt.nnodes));
  }
  if (!opt.master_addr.empty()) {
    addrinfo hints{};
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (int rc = getaddrinfo(opt.master_addr.c_str(), nullptr, &hints, &found); rc != 0) {
      throw std::invalid_argument(
          fmt::format("--master-addr '{}': does not resolve ({})", opt.master_addr, gai_strerror(rc)));
    }
    freeaddrinfo(found);
  }
  if (opt.command.empty()) throw std::invalid_argument("dcp launch: no command given after --");
}

int launch_local(const LaunchOptions& opt) {
  validate_launch_options(opt);
  struct sigaction sa{};
  sa.sa_handler = on_signal;  // no SA_RESTART: a sleep or wait must return on a signal
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);

  const std::string addr = opt.master_addr.empty() ? "127.0.0.1" : opt.master_addr;
  const int port = opt.master_port != 0 ? opt.master_port
                                        : free_port(opt.master_addr.empty() ? htonl(INADDR_LOOPBACK) : INADDR_ANY);
  int watcher_fd = -1;
  const pid_t watcher = start_watcher(&watcher_fd);
  const pid_t self = getpid();
  std::map<pid_t, int> running;  // pid (= its process group id) -> local rank
  std::vector<pid_t> groups;     // of every rank started
  for (int r = 0; r < opt.nproc; ++r) {
    pid_t pid = fork();
    if (pid < 0) throw std::runtime_error(fmt::format("fork failed for rank {}: {}", r, std::strerror(errno)));
    if (pid == 0) exec_rank(opt, r, addr, port, self);
    setpgid(pid, pid);  // also here: a signal sent before the child ran its setpgid must find the group
    tell_watcher(watcher_fd, pid);
    running[pid] = r;
    groups.push_back(pid);
  }

  int result = 0;
  bool stopping = false;
  std::chrono::steady_clock::time_point kill_deadline;
  // A rank's exit is read with WNOWAIT and the rank reaped only at the end: its zombie keeps its process-group
  // id from being reused, so signalling -pgid can never reach an unrelated group.
  auto signal_all = [&](int sig) {
    for (pid_t g : groups) kill(-g, sig);
  };
  auto begin_stop = [&](int code) {
    stopping = true;
    if (result == 0) result = code;
    kill_deadline = std::chrono::steady_clock::now() +
                    std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                        std::chrono::duration<double>(opt.grace_s));
    signal_all(SIGTERM);
  };
  while (!running.empty()) {
    bool reaped = false;
    for (auto it = running.begin(); it != running.end();) {
      siginfo_t si{};
      if (waitid(P_PID, it->first, &si, WEXITED | WNOHANG | WNOWAIT) != 0 || si.si_pid != it->first) {
        ++it;
        continue;
      }
      const auto [pid, rank] = *it;
      it = running.erase(it);
      reaped = true;
      bool failed = !(si.si_code == CLD_EXITED && si.si_status == 0);
      if (failed && !stopping) {
        fmt::print(stderr, "dcp launch: rank {} (pid {}) {}{}\n", opt.node_rank * opt.nproc + rank, pid,
                   describe(si),
                   running.empty() ? "" : fmt::format("; stopping the other {} rank(s)", running.size()));
        begin_stop(exit_code(si));
      }
    }
    if (reaped) continue;
    if (g_stop_signal != 0 && !stopping) {
      fmt::print(stderr, "dcp launch: got signal {}; stopping {} rank(s)\n", static_cast<int>(g_stop_signal),
                 running.size());
      begin_stop(128 + g_stop_signal);
      continue;
    }
    if (stopping && std::chrono::steady_clock::now() > kill_deadline) {
      signal_all(SIGKILL);  // also ends a stopped (hung) rank
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(stopping ? 50 : 20));
  }
  // Whatever a rank left running in its group (a background job) does not outlive the job.
  signal_all(SIGKILL);
  for (pid_t g : groups) waitpid(g, nullptr, 0);
  tell_watcher(watcher_fd, 0);
  close(watcher_fd);
  waitpid(watcher, nullptr, 0);
  return result;
}

}  // namespace dcp
