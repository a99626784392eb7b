// Writing whole files so that a full disk or a read-only folder is an error naming the file and the reason,
// never a truncated file that looks complete.
#pragma once

#include <filesystem>
#include <string_view>

namespace dcp {

/// Writes `data` to `path` (replacing it), flushed and synced. On failure removes the partial file and throws
/// std::runtime_error "cannot write '<path>': <strerror>" (e.g. "No space left on device").
void write_file_checked(const std::filesystem::path& path, std::string_view data);

/// write_file_checked to a temporary file beside `path` (named by `tag` and the process id, so that concurrent
/// writers do not share it), then renamed over `path`: readers see the old file or the whole new one, never a
/// partial one. Throws std::runtime_error naming `path` and the reason.
void write_file_atomically(const std::filesystem::path& path, std::string_view data, std::string_view tag = "");

/// Appends one line (and a newline) to `path`, flushed. Throws std::runtime_error naming the file and the
/// reason when the write fails; a partial line is truncated away, so the file keeps only whole lines.
void append_line_checked(const std::filesystem::path& path, std::string_view line);

}  // namespace dcp
