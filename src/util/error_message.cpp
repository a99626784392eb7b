#include "util/error_message.h"

#include <c10/util/Exception.h>

namespace dcp {

std::string error_message(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  // Our own messages may embed a c10 message (with its backtrace) after a colon.
  std::string text = e.what();
  for (const char* marker : {"\nException raised from", "\nframe #"}) {
    auto pos = text.find(marker);
    if (pos != std::string::npos) text.erase(pos);
  }
  return text;
}

}  // namespace dcp
