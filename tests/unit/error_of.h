// Test helper: the message of the exception a callable throws.
#pragma once

#include <stdexcept>
#include <string>

namespace dcp::test {

/// The what() of the std::exception that `f` throws, or "" when it throws none.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace dcp::test
