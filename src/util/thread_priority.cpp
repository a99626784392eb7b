#include "util/thread_priority.h"

#include <fmt/format.h>
#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace dcp {

ThreadPriority parse_thread_priority(const std::string& name, const std::string& what) {
  if (name == "normal") return ThreadPriority::normal;
  if (name == "low") return ThreadPriority::low;
  if (name == "idle") return ThreadPriority::idle;
  throw std::invalid_argument(fmt::format("{}: '{}' is none of normal, low, idle", what, name));
}

const char* thread_priority_name(ThreadPriority priority) {
  switch (priority) {
    case ThreadPriority::low: return "low";
    case ThreadPriority::idle: return "idle";
    case ThreadPriority::normal: break;
  }
  return "normal";
}

std::string lower_this_thread(ThreadPriority priority) {
  int err = 0;
  if (priority == ThreadPriority::idle) {
    sched_param param{};
    param.sched_priority = 0;
    err = pthread_setschedparam(pthread_self(), SCHED_IDLE, &param);
  } else if (priority == ThreadPriority::low) {
    // setpriority on a thread id sets that thread's nice value alone (Linux: nice is per thread).
    if (setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), 19) != 0) err = errno;
  }
  return err == 0 ? std::string() : std::string(std::strerror(err));
}

}  // namespace dcp
