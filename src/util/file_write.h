// Writing whole files so that a full disk or a read-only folder is an error naming the file and the reason,
// never a truncated file that looks complete.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

namespace dcp {

/// Writes `data` to `path` (replacing it), flushed and synced. On failure removes the partial file and throws
/// std::runtime_error "cannot write '<path>': <strerror>" (e.g. "No space left on device").
void write_file_checked(const std::filesystem::path& path, std::string_view data);

/// write_file_checked to a temporary file beside `path` (named by `tag` and the process id, so that concurrent
/// writers do not share it), then renamed over `path`: readers see the old file or the whole new one, never a
/// partial one. Throws std::runtime_error naming `path` and the reason.
void write_file_atomically(const std::filesystem::path& path, std::string_view data, std::string_view tag = "");

/// fsync(2) of the folder `dir`, so that the names created or renamed in it survive a power loss as well as a
/// crash. Throws std::runtime_error "cannot sync the folder '<dir>': <strerror>".
void sync_folder(const std::filesystem::path& dir);

/// Why new files cannot be written in the folder `dir`, or "" when they can: creates it (and its parents) when
/// missing, then creates and removes a probe file in it, so that a read-only or foreign folder is found before
/// a long computation rather than at its end. The reason reads "'<dir>' is not a folder", "cannot create the
/// folder '<dir>': <reason>" or "cannot create a file in the folder '<dir>': <strerror>". Throws nothing.
std::string folder_write_problem(const std::filesystem::path& dir);

/// Appends one line (and a newline) to `path`, flushed. Throws std::runtime_error naming the file and the
/// reason when the write fails; a partial line is truncated away, so the file keeps only whole lines.
void append_line_checked(const std::filesystem::path& path, std::string_view line);

}  // namespace dcp
