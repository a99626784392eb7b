// Rank-aware logging: rank 0 prints to the terminal, every rank writes run_dir/logs/rank<N>.log.
#pragma once

#include <spdlog/spdlog.h>

#include <string>

namespace dcp {

/// Installs the default spdlog logger. Errors are printed to stderr by every rank, so a failing rank is seen.
/// The log file is appended to, never truncated (a retry keeps the evidence of the failure it retries): each
/// invocation starts with a line "==== <what> begins: pid P ====" in the file. Throws spdlog::spdlog_ex when
/// the log file cannot be created.
void init_logging(const std::string& run_dir, int64_t rank, const std::string& level, const std::string& what);

/// Throws std::runtime_error with spdlog's message (it names the log file and the OS error: "Failed writing to
/// file ...: No space left on device") when a log write failed since init_logging. spdlog reports such errors
/// to a handler, inside the logging call, where throwing is unsafe; callers check between steps.
void throw_if_logging_failed();

}  // namespace dcp
