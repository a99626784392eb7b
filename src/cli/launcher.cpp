#include "cli/launcher.h"

#include <arpa/inet.h>
#include <fmt/format.h>
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

namespace dcp {
namespace {

volatile sig_atomic_t g_stop_signal = 0;
void on_signal(int sig) { g_stop_signal = sig; }

int free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(fmt::format("socket() failed: {}", std::strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(fd);
    throw std::runtime_error(fmt::format("no free port on 127.0.0.1: {}", std::strerror(errno)));
  }
  close(fd);
  return ntohs(addr.sin_port);
}

[[noreturn]] void exec_rank(const LaunchOptions& opt, int rank, int port) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);  // a launcher killed with SIGKILL must not leave ranks behind
  setenv("RANK", std::to_string(rank).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(opt.nproc).c_str(), 1);
  setenv("LOCAL_WORLD_SIZE", std::to_string(opt.nproc).c_str(), 1);
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  bool is_program = opt.command[0].find('/') != std::string::npos;
  std::vector<std::string> args;
  if (!is_program) args.push_back("dcp");
  args.insert(args.end(), opt.command.begin(), opt.command.end());
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  execv(is_program ? opt.command[0].c_str() : "/proc/self/exe", argv.data());
  fmt::print(stderr, "dcp launch: cannot start rank {} ({}): {}\n", rank, args[0], std::strerror(errno));
  _exit(127);
}

std::string describe(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return "stopped";
}

int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

int launch_local(const LaunchOptions& opt) {
  if (opt.nproc < 1) throw std::invalid_argument(fmt::format("--nproc {}: must be >= 1", opt.nproc));
  if (opt.command.empty()) throw std::invalid_argument("dcp launch: no command given after --");
  struct sigaction sa{};
  sa.sa_handler = on_signal;  // no SA_RESTART: waitpid must return on a signal
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);

  const int port = free_port();
  std::map<pid_t, int> running;  // pid -> rank
  for (int r = 0; r < opt.nproc; ++r) {
    pid_t pid = fork();
    if (pid < 0) throw std::runtime_error(fmt::format("fork failed for rank {}: {}", r, std::strerror(errno)));
    if (pid == 0) exec_rank(opt, r, port);
    running[pid] = r;
  }

  int result = 0;
  bool stopping = false;
  std::chrono::steady_clock::time_point kill_deadline;
  auto signal_all = [&](int sig) {
    for (const auto& [pid, rank] : running) kill(pid, sig);
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
    int status = 0;
    pid_t pid = waitpid(-1, &status, stopping ? WNOHANG : 0);
    if (pid > 0) {
      int rank = running.at(pid);
      running.erase(pid);
      bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
      if (failed && !stopping) {
        fmt::print(stderr, "dcp launch: rank {} (pid {}) {}{}\n", rank, pid, describe(status),
                   running.empty() ? "" : fmt::format("; stopping the other {} rank(s)", running.size()));
        begin_stop(exit_code(status));
      }
      continue;
    }
    if (g_stop_signal != 0 && !stopping) {
      fmt::print(stderr, "dcp launch: got signal {}; stopping {} rank(s)\n", static_cast<int>(g_stop_signal),
                 running.size());
      begin_stop(128 + g_stop_signal);
      continue;
    }
    if (stopping) {
      if (std::chrono::steady_clock::now() > kill_deadline) signal_all(SIGKILL);  // also ends a stopped (hung) rank
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  return result;
}

}  // namespace dcp
