#include "util/error_message.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>

#include "util/file_write.h"

namespace dcp {

std::string error_message(const std::exception& e) {
  // LibTorch's c10::Error::what() is what_without_backtrace() followed by its backtrace, which starts on a new
  // line with "Exception raised from" (or "frame #" for a captured one); our own messages may embed such a
  // message after a colon. Cutting at the marker gives the same text without linking LibTorch here.
  std::string text = e.what();
  for (const char* marker : {"\nException raised from", "\nframe #"}) {
    auto pos = text.find(marker);
    if (pos != std::string::npos) text.erase(pos);
  }
  return text;
}

void write_error_file(const std::string& kind, int exit_code, const std::string& message) {
  const char* path = std::getenv("DCP_ERROR_FILE");
  if (path == nullptr || *path == '\0') return;
  try {
    write_file_atomically(path, nlohmann::json{{"kind", kind}, {"exit_code", exit_code}, {"message", message}}.dump() +
                                    "\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dcp: cannot write the error file DCP_ERROR_FILE='%s': %s\n", path, e.what());
  }
}

}  // namespace dcp
