#include "tools/bench_common.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <fmt/chrono.h>
#include <fmt/format.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "util/file_write.h"

namespace fs = std::filesystem;

namespace dcp {

std::string blas_description() {
  // OpenBLAS picks its kernels from the CPUID model at load time, and a model it does not know (as on some
  // virtual machines) gets the generic Prescott kernels at a fraction of the fp32 rate: the report must say which.
  using Config = char* (*)();
  const auto config = reinterpret_cast<Config>(dlsym(RTLD_DEFAULT, "openblas_get_config"));
  if (config == nullptr) return "not OpenBLAS";
  const char* text = config();
  return text ? text : "OpenBLAS (no configuration string)";
}

bool gnuplot_available() {
  const char* path = std::getenv("PATH");
  std::stringstream ss(path ? path : "");
  for (std::string dir; std::getline(ss, dir, ':');) {
    if (!dir.empty() && access((fs::path(dir) / "gnuplot").c_str(), X_OK) == 0) return true;
  }
  return false;
}

std::string own_command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::vector<std::string> args;
  for (std::string a; std::getline(in, a, '\0');) args.push_back(a);
  std::string out;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string a = i == 0 ? fs::path(args[0]).string() : args[i];
    const bool plain = !a.empty() && a.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                         "0123456789-_./=,:+@%") == std::string::npos;
    if (!plain) {
      std::string q = "'";
      for (char c : a) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
      a = q + "'";
    }
    out += (i ? " " : "") + a;
  }
  return out;
}

std::string utc_now(const std::string& format) {
  return fmt::format(fmt::runtime("{:" + format + "}"), fmt::gmtime(std::time(nullptr)));
}

double load_average_1min() {
  std::ifstream in("/proc/loadavg");
  double load = -1;
  in >> load;
  return load;
}

int run_child(const std::vector<std::string>& args, const fs::path& log_path) {
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error(fmt::format("fork failed: {}", std::strerror(errno)));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // a bench killed with SIGKILL takes its child (a slice and its ranks) along
    int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) {
      fmt::print(stderr, "dcp: cannot write '{}': {}\n", log_path.string(), std::strerror(errno));
      _exit(127);
    }
    dup2(fd, 1);
    dup2(fd, 2);
    close(fd);
    std::vector<std::string> copy = args;
    std::vector<char*> argv;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    fmt::print(stderr, "dcp: cannot start {}: {}\n", args[0], std::strerror(errno));
    _exit(127);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) throw std::runtime_error(fmt::format("waitpid failed: {}", std::strerror(errno)));
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

void write_text(const fs::path& path, const std::string& text) { write_file_checked(path, text); }

void run_gnuplot(const std::string& script, const fs::path& script_path, const fs::path& log_path) {
  write_text(script_path, script);
  const int code = run_child({"/bin/sh", "-c", "exec gnuplot \"$0\"", script_path.string()}, log_path);
  if (code != 0) {
    throw std::runtime_error(
        fmt::format("gnuplot {} failed with exit code {}; see {}", script_path.string(), code, log_path.string()));
  }
}

double physical_memory_bytes() {
  return static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
}

}  // namespace dcp
