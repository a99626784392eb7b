// What the benchmark commands (`dcp bench`, `dcp bench-attention`) share: the command line and machine load for
// their reports, writing files, and running a child such as gnuplot.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace dcp {

/// The exact command line of this process, shell-quoted where needed, with argv[0] as given.
std::string own_command_line();

/// The current UTC time in a strftime `format`, e.g. "%Y-%m-%d %H:%M".
std::string utc_now(const std::string& format);

/// Physical RAM of this machine (sysconf pages x page size), bytes.
double physical_memory_bytes();

/// The 1-minute load average of /proc/loadavg; -1 when it cannot be read.
double load_average_1min();

/// The BLAS build this process runs fp32 matmuls on, as OpenBLAS describes itself (openblas_get_config(), e.g.
/// "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY SkylakeX MAX_THREADS=64": the kernel family it chose for this CPU),
/// or "not OpenBLAS" when no OpenBLAS is loaded. Looked up at run time, so the build needs no OpenBLAS headers.
std::string blas_description();

/// Whether an executable `gnuplot` is on PATH.
bool gnuplot_available();

/// Runs args (args[0] is a path) with stdout and stderr into log_path and waits. Returns its exit code, or 128 +
/// the signal that killed it; the child is killed with this process. Throws std::runtime_error when fork fails.
int run_child(const std::vector<std::string>& args, const std::filesystem::path& log_path);

/// Writes `script` to script_path and runs gnuplot on it, its output into log_path. Throws std::runtime_error
/// naming the script and the log when gnuplot fails.
void run_gnuplot(const std::string& script, const std::filesystem::path& script_path,
                 const std::filesystem::path& log_path);

/// Writes `text` to `path`; throws std::runtime_error naming the path when it cannot.
void write_text(const std::filesystem::path& path, const std::string& text);

}  // namespace dcp
