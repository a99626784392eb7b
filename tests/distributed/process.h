// Spawning and supervising child processes in tests (the dcp binary, ranks started by hand).
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace dcp::test {

/// A child process whose stdout and stderr go to `log_path`.
struct Child {
  pid_t pid = -1;
  std::string log_path;

  /// `env` adds or replaces variables of this process's environment; the child does not see those named in `unset`.
  static Child spawn(const std::vector<std::string>& args, const std::map<std::string, std::string>& env,
                     const std::string& log_path, const std::vector<std::string>& unset = {}) {
    std::vector<std::string> env_strings;
    for (char** e = environ; *e; ++e) {
      std::string s(*e);
      const std::string name = s.substr(0, s.find('='));
      if (!env.count(name) && std::find(unset.begin(), unset.end(), name) == unset.end()) env_strings.push_back(s);
    }
    for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
    std::vector<char*> argv, envp;
    std::vector<std::string> args_copy = args;
    for (auto& a : args_copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (auto& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    Child c;
    c.log_path = log_path;
    if (posix_spawn(&c.pid, argv[0], &fa, nullptr, argv.data(), envp.data()) != 0) {
      throw std::runtime_error("cannot spawn " + args[0]);
    }
    posix_spawn_file_actions_destroy(&fa);
    return c;
  }

  /// Waits up to `timeout_s`; returns the wait status, or -1 on time-out (the child is then killed).
  int wait(double timeout_s) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
    while (std::chrono::steady_clock::now() < deadline) {
      int status = 0;
      if (waitpid(pid, &status, WNOHANG) == pid) {
        pid = -1;
        return status;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    kill_now();
    return -1;
  }

  void kill_now() {
    if (pid <= 0) return;
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    pid = -1;
  }

  std::string log() const {
    std::ifstream in(log_path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  ~Child() { kill_now(); }
  Child() = default;
  Child(Child&& o) noexcept : pid(o.pid), log_path(std::move(o.log_path)) { o.pid = -1; }
  Child& operator=(Child&&) = delete;
};

inline bool exited_ok(int status) { return status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0; }

}  // namespace dcp::test
