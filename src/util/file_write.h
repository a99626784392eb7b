// Writing whole files so that a full disk or a read-only folder is an error naming the file and the reason,
// never a truncated file that looks complete.
#pragma once

#include <filesystem>
#include <string_view>

namespace dcp {

/// Writes `data` to `path` (replacing it), flushed and synced. On failure removes the partial file and throws
/// std::runtime_error "cannot write '<path>': <strerror>" (e.g. "No space left on device").
void write_file_checked(const std::filesystem::path& path, std::string_view data);

/// Appends one line (and a newline) to `path`, flushed. Throws std::runtime_error naming the file and the
/// reason when the write fails; a partial line is truncated away, so the file keeps only whole lines.
void append_line_checked(const std::filesystem::path& path, std::string_view line);

}  // namespace dcp
