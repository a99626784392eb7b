// User-facing text of an exception: LibTorch errors carry a C++ backtrace that users should not see.
#pragma once

#include <exception>
#include <string>

namespace dcp {

/// e.what() without the backtrace LibTorch (c10::Error) appends; nested messages keep their first part.
std::string error_message(const std::exception& e);

}  // namespace dcp
