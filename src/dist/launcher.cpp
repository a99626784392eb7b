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
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <vector>

#include "dist/elastic.h"
#include "dist/launch_round.h"

extern char** environ;

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

// A rank's program, arguments and environment, built before fork(): the launcher may have threads (the store of an
// elastic job, verify-plan's caller), so the child makes only async-signal-safe calls until execve.
struct RankExec {
  std::string path;
  std::vector<std::string> args, env;
  std::string exec_error;     // written to stderr if execve fails
  std::vector<char*> argv, envp;  // into args and env: point() once the RankExec no longer moves

  void point() {
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
  }
};

RankExec prepare_rank(const LaunchOptions& opt, const RoundSetup& setup, int local_rank) {
  const int rank = opt.node_rank * opt.nproc + local_rank;
  std::vector<std::pair<std::string, std::string>> vars = {
      {"RANK", std::to_string(rank)},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"WORLD_SIZE", std::to_string(opt.nnodes * opt.nproc)},
      {"LOCAL_WORLD_SIZE", std::to_string(opt.nproc)},
      {"MASTER_ADDR", setup.addr},
      {"MASTER_PORT", std::to_string(setup.port)}};
  vars.insert(vars.end(), setup.env.begin(), setup.env.end());
  if (!setup.error_file_prefix.empty()) {
    vars.emplace_back("DCP_ERROR_FILE", fmt::format("{}rank{}.json", setup.error_file_prefix, rank));
  }
  RankExec x;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string s(*e);
    const std::string name = s.substr(0, s.find('='));
    bool replaced = false;
    for (const auto& v : vars) replaced = replaced || v.first == name;
    if (!replaced) x.env.push_back(s);
  }
  for (const auto& [k, v] : vars) x.env.push_back(k + "=" + v);
  const bool is_program = setup.command[0].find('/') != std::string::npos;
  if (!is_program) x.args.push_back("dcp");
  x.args.insert(x.args.end(), setup.command.begin(), setup.command.end());
  x.path = is_program ? setup.command[0] : "/proc/self/exe";
  x.exec_error = fmt::format("dcp launch: cannot start rank {} ({}): ", local_rank, x.args[0]);
  return x;
}

[[noreturn]] void exec_rank(RankExec& x, pid_t launcher) {
  // Its own process group, so that signalling the group reaches the rank's children too (a shell's background
  // jobs, a program the rank starts); the launcher signals -pgid.
  setpgid(0, 0);
  prctl(PR_SET_PDEATHSIG, SIGKILL);  // a launcher killed with SIGKILL must not leave ranks behind
  if (getppid() != launcher) _exit(1);  // it died before prctl took effect
  // The launcher's handlers do not survive in the rank: execve resets handled signals to their defaults.
  execve(x.path.c_str(), x.argv.data(), x.envp.data());
  const char* why = strerror(errno);  // glibc: a static table, no allocation
  ssize_t ignored = write(2, x.exec_error.data(), x.exec_error.size());
  ignored = write(2, why, std::strlen(why));
  ignored = write(2, "\n", 1);
  (void)ignored;
  _exit(127);
}

std::string describe(const siginfo_t& si) {
  if (si.si_code == CLD_EXITED) return fmt::format("exited with code {}", si.si_status);
  return fmt::format("was killed by signal {} ({})", si.si_status, strsignal(si.si_status));
}

int exit_code(const siginfo_t& si) { return si.si_code == CLD_EXITED ? si.si_status : 128 + si.si_status; }

// What a failed rank says about itself in its error file (main() writes it), with the kind a restart needs.
Failure failure_of(const LaunchOptions& opt, const RoundSetup& setup, int local_rank, pid_t pid, const siginfo_t& si) {
  Failure f;
  f.node = opt.node_rank;
  f.rank = opt.node_rank * opt.nproc + local_rank;
  f.code = exit_code(si);
  f.what = fmt::format("rank {} (node {}, pid {}) {}", f.rank, f.node, pid, describe(si));
  f.kind = si.si_code == CLD_EXITED ? (si.si_status == 2 ? "usage" : "runtime") : "signal";
  if (!setup.error_file_prefix.empty() && si.si_code == CLD_EXITED) {
    std::ifstream in(fmt::format("{}rank{}.json", setup.error_file_prefix, f.rank));
    std::stringstream text;
    text << in.rdbuf();
    const nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
    if (j.is_object()) {
      f.message = j.value("message", "");
      if (si.si_status != 2) f.kind = j.value("kind", f.kind);
    }
  }
  return f;
}

// The watcher: SIGKILL reaches the launcher with no chance to clean up, and PDEATHSIG reaches only the ranks
// themselves, not their children. This child of the launcher reads the ranks' process-group ids from a pipe;
// when the pipe closes without the end mark (0), the launcher died, and it SIGKILLs those groups (-1 forgets the
// groups of a finished round). Only async-signal-safe calls after fork().
constexpr int kMaxRanks = 1024;

}  // namespace

nlohmann::json Failure::to_json() const {
  return {{"node", node}, {"rank", rank}, {"code", code}, {"kind", kind}, {"what", what}, {"message", message}};
}

Failure Failure::from_json(const nlohmann::json& j) {
  Failure f;
  if (!j.is_object()) return f;
  f.node = j.value("node", 0);
  f.rank = j.value("rank", -1);
  f.code = j.value("code", 1);
  f.kind = j.value("kind", "runtime");
  f.what = j.value("what", "");
  f.message = j.value("message", "");
  return f;
}

std::string Failure::describe() const { return message.empty() ? what : what + ": " + message; }

Watcher::Watcher() {
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
      if (g == -1) {
        n = 0;
        continue;
      }
      if (n < kMaxRanks) groups[n++] = g;
    }
    for (int i = 0; i < n; ++i) kill(-groups[i], SIGKILL);
    _exit(0);
  }
  close(fds[0]);
  fd_ = fds[1];
  pid_ = pid;
}

namespace {
void tell_watcher(int fd, int32_t value) {
  if (write(fd, &value, sizeof(value)) != static_cast<ssize_t>(sizeof(value))) {
    fmt::print(stderr, "dcp launch: cannot reach the watcher process: {}\n", std::strerror(errno));
  }
}
}  // namespace

void Watcher::add(pid_t group) { tell_watcher(fd_, group); }
void Watcher::clear() { tell_watcher(fd_, -1); }
Watcher::~Watcher() {
  tell_watcher(fd_, 0);
  close(fd_);
  waitpid(pid_, nullptr, 0);
}

void install_stop_handlers() {
  struct sigaction sa{};
  sa.sa_handler = on_signal;  // no SA_RESTART: a sleep or wait must return on a signal
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);
}

int stop_signal() { return g_stop_signal; }

bool sleep_unless_stopped(double seconds) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                            std::chrono::duration<double>(seconds));
  while (std::chrono::steady_clock::now() < until) {
    if (g_stop_signal != 0) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return g_stop_signal == 0;
}

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
  if (opt.max_restarts < 0) {
    throw std::invalid_argument(fmt::format("--max-restarts {}: must be >= 0", opt.max_restarts));
  }
  if (!(std::isfinite(opt.restart_backoff_s) && opt.restart_backoff_s >= 0)) {
    throw std::invalid_argument(fmt::format("--restart-backoff-s {}: must be a finite number >= 0", opt.restart_backoff_s));
  }
  if (!(std::isfinite(opt.join_timeout_s) && opt.join_timeout_s > 0)) {
    throw std::invalid_argument(fmt::format("--join-timeout-s {}: must be a finite number > 0", opt.join_timeout_s));
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

RoundResult launch_round(const LaunchOptions& opt, const RoundSetup& setup, Watcher& watcher,
                         const std::function<bool()>& peer_failed, const std::function<void(const Failure&)>& on_failure) {
  const pid_t self = getpid();
  std::vector<RankExec> execs;
  for (int r = 0; r < opt.nproc; ++r) execs.push_back(prepare_rank(opt, setup, r));
  for (auto& x : execs) x.point();
  std::map<pid_t, int> running;  // pid (= its process group id) -> local rank
  std::vector<pid_t> groups;     // of every rank started
  RoundResult out;
  auto signal_all = [&](int sig) {
    for (pid_t g : groups) kill(-g, sig);
  };
  for (int r = 0; r < opt.nproc; ++r) {
    pid_t pid = fork();
    if (pid < 0) {
      const std::string why = std::strerror(errno);
      signal_all(SIGKILL);
      for (pid_t g : groups) waitpid(g, nullptr, 0);
      throw std::runtime_error(fmt::format("fork failed for rank {}: {}", r, why));
    }
    if (pid == 0) exec_rank(execs[static_cast<size_t>(r)], self);
    setpgid(pid, pid);  // also here: a signal sent before the child ran its setpgid must find the group
    watcher.add(pid);
    running[pid] = r;
    groups.push_back(pid);
  }

  bool stopping = false;
  std::chrono::steady_clock::time_point kill_deadline;
  auto next_poll = std::chrono::steady_clock::now();
  // A rank's exit is read with WNOWAIT and the rank reaped only at the end: its zombie keeps its process-group
  // id from being reused, so signalling -pgid can never reach an unrelated group.
  auto begin_stop = [&] {
    stopping = true;
    kill_deadline = std::chrono::steady_clock::now() +
                    std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                        std::chrono::duration<double>(opt.grace_s));
    signal_all(SIGTERM);
    signal_all(SIGCONT);  // a stopped (SIGSTOP) rank takes the SIGTERM now rather than at SIGKILL
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
      const bool failed = !(si.si_code == CLD_EXITED && si.si_status == 0);
      if (failed && !stopping) {
        Failure f = failure_of(opt, setup, rank, pid, si);
        fmt::print(stderr, "dcp launch: {}{}\n", f.what,
                   running.empty() ? "" : fmt::format("; stopping the other {} rank(s)", running.size()));
        out.failure = f;
        if (on_failure) on_failure(f);
        begin_stop();
      }
    }
    if (reaped) continue;
    if (g_stop_signal != 0 && !stopping) {
      fmt::print(stderr, "dcp launch: got signal {}; stopping {} rank(s)\n", static_cast<int>(g_stop_signal),
                 running.size());
      out.launcher_signal = g_stop_signal;
      begin_stop();
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    if (!stopping && peer_failed && now >= next_poll) {
      next_poll = now + std::chrono::milliseconds(250);
      if (peer_failed()) {
        fmt::print(stderr, "dcp launch: a rank of another node failed; stopping {} rank(s) of node {}\n",
                   running.size(), opt.node_rank);
        out.stopped_for_peer = true;
        begin_stop();
        continue;
      }
    }
    if (stopping && now > kill_deadline) {
      signal_all(SIGKILL);  // also ends a stopped (hung) rank
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(stopping ? 50 : 20));
  }
  // Whatever a rank left running in its group (a background job) does not outlive the job.
  signal_all(SIGKILL);
  for (pid_t g : groups) waitpid(g, nullptr, 0);
  watcher.clear();
  out.ok = !out.failure && !out.stopped_for_peer && out.launcher_signal == 0;
  return out;
}

int launch_local(const LaunchOptions& opt) {
  validate_launch_options(opt);
  install_stop_handlers();
  if (opt.max_restarts > 0) return launch_elastic(opt);
  RoundSetup setup;
  setup.addr = opt.master_addr.empty() ? "127.0.0.1" : opt.master_addr;
  setup.port = opt.master_port != 0 ? opt.master_port
                                    : free_port(opt.master_addr.empty() ? htonl(INADDR_LOOPBACK) : INADDR_ANY);
  setup.command = opt.command;
  Watcher watcher;
  const RoundResult r = launch_round(opt, setup, watcher, nullptr, nullptr);
  if (r.failure) return r.failure->code;
  if (r.launcher_signal != 0) return 128 + r.launcher_signal;
  return 0;
}

int free_loopback_port() { return free_port(htonl(INADDR_LOOPBACK)); }

}  // namespace dcp
