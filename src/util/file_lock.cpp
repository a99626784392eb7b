#include "util/file_lock.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace dcp {

FileLock::FileLock(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw std::runtime_error(fmt::format("cannot open the lock file '{}': {}", path_, std::strerror(errno)));
}

FileLock::~FileLock() { ::close(fd_); }  // closing the last descriptor releases the lock

bool FileLock::try_lock() {
  if (held_) return true;
  if (::flock(fd_, LOCK_EX | LOCK_NB) == 0) return held_ = true;
  if (errno == EWOULDBLOCK) return false;
  throw std::runtime_error(fmt::format("cannot lock '{}': {}", path_, std::strerror(errno)));
}

void FileLock::set_holder_note(const std::string& note) {
  if (!held_) throw std::runtime_error(fmt::format("the lock '{}' is not held", path_));
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, note.data(), note.size(), 0) != static_cast<ssize_t>(note.size())) {
    throw std::runtime_error(fmt::format("cannot write the lock file '{}': {}", path_, std::strerror(errno)));
  }
}

std::string FileLock::holder_note() const {
  std::string out(256, '\0');
  const ssize_t n = ::pread(fd_, out.data(), out.size(), 0);
  out.resize(n > 0 ? static_cast<size_t>(n) : 0);
  while (!out.empty() && (out.back() == '\n' || out.back() == '\0')) out.pop_back();
  return out;
}

}  // namespace dcp
