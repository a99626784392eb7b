// User-facing text of an exception: LibTorch errors carry a C++ backtrace that users should not see.
#pragma once

#include <exception>
#include <stdexcept>
#include <string>

namespace dcp {

/// e.what() without the backtrace LibTorch (c10::Error) appends; nested messages keep their first part.
std::string error_message(const std::exception& e);

/// A failure that a restart would meet again, tagged with the kind `dcp launch --max-restarts` reads from the
/// rank's error file (write_error_file): kFailureCheckpointRefused (no checkpoint to resume from passes
/// verification, or it belongs to another config or corpus) or kFailureNonfinite (a non-finite loss or gradient
/// norm stopped the run). Any other exception is of kind "runtime" (exit 1), a ConfigError of kind "usage" (exit 2).
struct RunFailure : std::runtime_error {
  RunFailure(const char* kind, const std::string& what) : std::runtime_error(what), kind(kind) {}
  const char* kind;
};
inline constexpr const char* kFailureCheckpointRefused = "checkpoint_refused";
inline constexpr const char* kFailureNonfinite = "nonfinite";

/// When the environment variable DCP_ERROR_FILE names a file (`dcp launch` sets one per rank, as torchelastic's
/// TORCHELASTIC_ERROR_FILE), writes {"kind", "exit_code", "message"} there as one JSON object, so that the
/// launcher can tell why the rank failed. Does nothing without the variable; never throws (a failure to write
/// is printed to stderr).
void write_error_file(const std::string& kind, int exit_code, const std::string& message);

}  // namespace dcp
