// One loop over independent work items on OpenMP threads, with the exception handling both of its users need
// (the decode kernel's (session, head) pairs, minimax's heads of a layer).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>

namespace dcp {

/// Runs body(i) for i in [0, count) on up to `threads` OpenMP threads, one index at a time to whichever thread is
/// free (schedule(dynamic, 1): the items differ in cost), and returns true. The first exception an index throws is
/// rethrown once every thread has stopped (indices not yet started are skipped). Runs nothing and returns false
/// when threads <= 1, count <= 1, or the including file is not compiled with OpenMP (a header template: its pragma
/// takes effect only where -fopenmp is on, CMakeLists.txt): the caller then does the work on its own thread.
template <class Body>
bool omp_for_each(int64_t count, int64_t threads, const Body& body) {
#ifdef _OPENMP
  if (threads > 1 && count > 1) {
    std::exception_ptr error;
    std::atomic<bool> failed{false};
#pragma omp parallel for num_threads(static_cast<int>(std::min(threads, count))) schedule(dynamic, 1)
    for (int64_t i = 0; i < count; ++i) {
      if (failed.load(std::memory_order_relaxed)) continue;
      try {
        body(i);
      } catch (...) {
#pragma omp critical(dcp_omp_for_each_error)
        {
          if (!error) error = std::current_exception();
        }
        failed = true;
      }
    }
    if (error) std::rethrow_exception(error);
    return true;
  }
#else
  (void)count;
  (void)threads;
  (void)body;
#endif
  return false;
}

}  // namespace dcp
