// Measured memory of this process: current and peak bytes of tensor storage, for the trainer's
// rank_peak_bytes and `dcp profile`'s fitted MemoryModel.
#pragma once

#include <cstdint>
#include <string>

namespace dcp {

/// A process-wide meter of CPU memory.
///
/// install() wraps c10's CPU allocator (c10::GetCPUAllocator, by default c10's DefaultCPUAllocator) in a
/// counting allocator registered with c10::SetCPUAllocator at priority 1 (above the default's 0, so it wins over
/// the default, and SetCPUAllocator's priority rule leaves it in place). It counts the requested bytes of every
/// CPU tensor storage allocated after install() (a 64-byte header in front of each block keeps its size for the
/// free, so no table or lock is needed); storage allocated before install() is not counted, and memory outside
/// tensor storage (library code, the corpus, oneDNN scratch space, allocator slack) is not either.
///
/// When the hook cannot be installed (another allocator of higher priority holds the slot, or the current one
/// has no raw deleter to call), the meter falls back to the process high-water mark: current = VmRSS and peak =
/// VmHWM of /proc/self/status, and reset_peak() writes "5" to /proc/self/clear_refs, which resets VmHWM to the
/// current RSS (Linux >= 4.0). method() says which one is in use; nothing else is tried.
///
/// install() runs from a static initializer of this file, before main(), in every program that links it (it
/// is linked whenever compute_step_gradients or profile_model is), so counts start with the first tensor.
/// Thread-safe: counters are atomics.
class MemoryMeter {
 public:
  /// Installs the counting allocator once per process (later calls do nothing) and returns method().
  static std::string install();
  /// "counting-allocator" or "process-high-water-mark" (also before install(): then the fallback is reported).
  static std::string method();
  /// Bytes of tensor storage alive now (counting allocator) or the resident set size (fallback), bytes.
  static int64_t current_bytes();
  /// The most bytes current_bytes() has reached since install() or the last reset_peak(), bytes.
  static int64_t peak_bytes();
  /// Starts a new peak window at current_bytes(). Throws std::runtime_error naming /proc/self/clear_refs when
  /// the fallback cannot reset the high-water mark.
  static void reset_peak();
};

/// The process high-water mark and resident set of /proc/self/status (VmHWM, VmRSS), bytes. Throws
/// std::runtime_error naming the file and the field when it cannot be read. Used by the fallback; public for
/// its test.
int64_t process_high_water_mark_bytes();
int64_t process_resident_bytes();

}  // namespace dcp
