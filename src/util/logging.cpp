#include "util/logging.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>

#include <filesystem>

namespace dcp {

void init_logging(const std::string& run_dir, int64_t rank, const std::string& level) {
  std::filesystem::create_directories(std::filesystem::path(run_dir) / "logs");
  auto file = std::make_shared<spdlog::sinks::basic_file_sink_mt>(
      (std::filesystem::path(run_dir) / "logs" / ("rank" + std::to_string(rank) + ".log")).string(), true);
  auto console = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  console->set_level(rank == 0 ? spdlog::level::from_str(level) : spdlog::level::err);
  auto logger = std::make_shared<spdlog::logger>("dcp", spdlog::sinks_init_list{console, file});
  logger->set_level(spdlog::level::trace);
  file->set_level(spdlog::level::from_str(level));
  logger->set_pattern(fmt::format("[%H:%M:%S] [rank {}] [%l] %v", rank));
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
}

}  // namespace dcp
