#include "util/logging.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <unistd.h>

#include <filesystem>
#include <mutex>
#include <stdexcept>

namespace dcp {

namespace {
std::mutex g_error_mutex;
std::string g_error;  // the first failed log write's message

void record_error(const std::string& message) {
  std::lock_guard<std::mutex> lock(g_error_mutex);
  if (g_error.empty()) g_error = message;
}
}  // namespace

void throw_if_logging_failed() {
  std::lock_guard<std::mutex> lock(g_error_mutex);
  if (!g_error.empty()) throw std::runtime_error("writing the log failed: " + g_error);
}

void init_logging(const std::string& run_dir, int64_t rank, const std::string& level, const std::string& what) {
  std::filesystem::create_directories(std::filesystem::path(run_dir) / "logs");
  auto file = std::make_shared<spdlog::sinks::basic_file_sink_mt>(
      (std::filesystem::path(run_dir) / "logs" / ("rank" + std::to_string(rank) + ".log")).string(), false);
  spdlog::logger header("header", file);
  header.set_error_handler(record_error);
  header.info("==== {} begins: pid {} ====", what, getpid());
  auto console = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  console->set_level(rank == 0 ? spdlog::level::from_str(level) : spdlog::level::err);
  auto logger = std::make_shared<spdlog::logger>("dcp", spdlog::sinks_init_list{console, file});
  logger->set_level(spdlog::level::trace);
  file->set_level(spdlog::level::from_str(level));
  logger->set_pattern(fmt::format("[%H:%M:%S] [rank {}] [%l] %v", rank));
  logger->flush_on(spdlog::level::info);
  logger->set_error_handler(record_error);
  spdlog::set_default_logger(logger);
}

}  // namespace dcp
