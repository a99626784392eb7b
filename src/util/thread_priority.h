// The CPU priority of one thread: what serve.http_priority sets on the server's connection threads and
// `dcp bench-serve --client-priority idle` on its clients.
#pragma once

#include <string>

namespace dcp {

enum class ThreadPriority {
  normal,  ///< unchanged
  low,     ///< nice 19 (CFS weight 15 against 1024 at nice 0): mostly the time other threads leave, a small share
  idle,    ///< Linux SCHED_IDLE: only time no other thread of the machine wants
};

/// "normal", "low" or "idle"; throws std::invalid_argument naming `what` (e.g. "serve.http_priority") and `name`.
ThreadPriority parse_thread_priority(const std::string& name, const std::string& what);
/// The name parse_thread_priority reads.
const char* thread_priority_name(ThreadPriority priority);
/// Lowers the calling thread to `priority` (normal: nothing). Returns "" or the kernel's refusal (strerror);
/// an unprivileged thread cannot raise its priority again.
std::string lower_this_thread(ThreadPriority priority);

}  // namespace dcp
