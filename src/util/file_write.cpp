#include "util/file_write.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

namespace dcp {
namespace fs = std::filesystem;

namespace {

[[noreturn]] void fail(const fs::path& path, int err) {
  throw std::runtime_error(fmt::format("cannot write '{}': {}", path.string(), std::strerror(err)));
}

// fwrite + fflush + fsync, so that ENOSPC surfaces here and not at a later close. Returns 0 or the errno.
int write_all(std::FILE* f, std::string_view data) {
  if (!data.empty() && std::fwrite(data.data(), 1, data.size(), f) != data.size()) return errno ? errno : EIO;
  if (std::fflush(f) != 0) return errno ? errno : EIO;
  if (fsync(fileno(f)) != 0 && errno != EINVAL) return errno;
  return 0;
}

}  // namespace

void write_file_checked(const fs::path& path, std::string_view data) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) fail(path, errno);
  int err = write_all(f, data);
  if (std::fclose(f) != 0 && err == 0) err = errno ? errno : EIO;
  if (err != 0) {
    std::error_code ignored;
    if (fs::is_regular_file(path, ignored)) fs::remove(path, ignored);  // never a device such as /dev/full
    fail(path, err);
  }
}

void sync_folder(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  const int err = fd < 0 ? errno : (fsync(fd) != 0 && errno != EINVAL ? errno : 0);
  if (fd >= 0) ::close(fd);
  if (err != 0) {
    throw std::runtime_error(fmt::format("cannot sync the folder '{}': {}", dir.string(), std::strerror(err)));
  }
}

std::string folder_write_problem(const fs::path& dir) {
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec)) return fmt::format("'{}' is not a folder", dir.string());
  fs::create_directories(dir, ec);
  if (ec) return fmt::format("cannot create the folder '{}': {}", dir.string(), ec.message());
  const fs::path probe = dir / fmt::format(".dcp-write-probe.{}", getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) return fmt::format("cannot create a file in the folder '{}': {}", dir.string(), std::strerror(errno));
  ::close(fd);
  fs::remove(probe, ec);
  return "";
}

void append_line_checked(const fs::path& path, std::string_view line) {
  std::error_code ec;
  const auto size_before = fs::is_regular_file(path, ec) ? fs::file_size(path, ec) : 0;
  std::FILE* f = std::fopen(path.c_str(), "ab");
  if (f == nullptr) fail(path, errno);
  std::string text(line);
  text += '\n';
  int err = write_all(f, text);
  if (std::fclose(f) != 0 && err == 0) err = errno ? errno : EIO;
  if (err != 0) {
    if (fs::is_regular_file(path, ec)) fs::resize_file(path, size_before, ec);
    fail(path, err);
  }
}

void write_file_atomically(const std::filesystem::path& path, std::string_view data, std::string_view tag) {
  const std::filesystem::path tmp = fmt::format("{}.{}{}.tmp", path.string(), tag, getpid());
  write_file_checked(tmp, data);
  std::error_code ec, ignored;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ignored);
    throw std::runtime_error(fmt::format("cannot write '{}': {}", path.string(), ec.message()));
  }
}

}  // namespace dcp
