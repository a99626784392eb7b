// Rank-aware logging: rank 0 prints to the terminal, every rank writes run_dir/logs/rank<N>.log.
#pragma once

#include <spdlog/spdlog.h>

#include <string>

namespace dcp {

/// Installs the default spdlog logger. Errors are printed to stderr by every rank, so a failing rank is seen.
/// Throws spdlog::spdlog_ex when the log file cannot be created.
void init_logging(const std::string& run_dir, int64_t rank, const std::string& level);

}  // namespace dcp
