#include "util/error_message.h"

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

}  // namespace dcp
