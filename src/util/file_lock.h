// An advisory lock on a file (flock), so that processes sharing a folder take turns at a step of their own.
#pragma once

#include <string>

namespace dcp {

/// An exclusive flock(2) on `path`, which is created when missing and left in place (removing a lock file
/// while another process waits on it would let a third one lock a new file of the same name). The lock is
/// advisory: it holds only against processes that take it too, and only where the file system supports flock
/// (local folders; NFS only where the client forwards it). Released on destruction, or when the process ends.
class FileLock {
 public:
  /// Opens (creates) the lock file without locking it. Throws std::runtime_error naming the file and the
  /// reason when it cannot be opened.
  explicit FileLock(std::string path);
  ~FileLock();
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

  /// Takes the lock if no other process holds it; true when this object holds it (then or before). Never
  /// blocks. Throws std::runtime_error naming the file when flock fails for another reason than a holder.
  bool try_lock();
  /// Replaces the lock file's content with `note` (who holds it: a pid), for a refused process to report.
  /// Requires the lock; throws std::runtime_error naming the file when it is not held or the write fails.
  void set_holder_note(const std::string& note);
  /// The lock file's content ("" when unreadable): the holder's note. Throws nothing.
  std::string holder_note() const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  bool held_ = false;
};

}  // namespace dcp
