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

}  // namespace dcp
