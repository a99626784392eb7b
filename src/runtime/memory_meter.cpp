#include "dcp/memory_meter.h"

#include <c10/core/CPUAllocator.h>
#include <fmt/format.h>

#include <atomic>
#include <cstring>
#include <fstream>
#include <mutex>
#include <stdexcept>

namespace dcp {
namespace {

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<bool> g_counting{false};

// The header keeps a block's size in front of it; its width is c10's alignment so the data stays aligned.
constexpr size_t kHeader = c10::gAlignment;
static_assert(kHeader >= sizeof(size_t), "header must hold the block size");

c10::Allocator* g_inner = nullptr;
c10::DeleterFnPtr g_inner_delete = nullptr;

void raise_peak(int64_t now) {
  int64_t seen = g_peak.load(std::memory_order_relaxed);
  while (now > seen && !g_peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
  }
}

void counted_delete(void* data) {
  if (data == nullptr) return;
  char* block = static_cast<char*>(data) - kHeader;
  size_t n = 0;
  std::memcpy(&n, block, sizeof(n));
  g_current.fetch_sub(static_cast<int64_t>(n), std::memory_order_relaxed);
  g_inner_delete(block);
}

// Wraps the allocator that was installed before it; data == context, so raw_allocate/raw_deallocate still work.
struct CountingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) const override {
    if (n == 0) return g_inner->allocate(0);
    char* block = static_cast<char*>(g_inner->raw_allocate(n + kHeader));
    std::memcpy(block, &n, sizeof(n));
    raise_peak(g_current.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed) + static_cast<int64_t>(n));
    void* data = block + kHeader;
    return {data, data, &counted_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }
};

int64_t status_field_bytes(const char* field) {
  std::ifstream in("/proc/self/status");
  const std::string key = std::string(field) + ":";
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(key.size())) * 1024;  // reported in kB
  }
  throw std::runtime_error(fmt::format("memory meter: cannot read {} from /proc/self/status", field));
}

}  // namespace

int64_t process_high_water_mark_bytes() { return status_field_bytes("VmHWM"); }
int64_t process_resident_bytes() { return status_field_bytes("VmRSS"); }

std::string MemoryMeter::install() {
  static std::once_flag once;
  std::call_once(once, [] {
    c10::Allocator* inner = c10::GetCPUAllocator();
    if (inner == nullptr || inner->raw_deleter() == nullptr) return;
    g_inner = inner;
    g_inner_delete = inner->raw_deleter();
    static CountingAllocator counting;
    c10::SetCPUAllocator(&counting, /*priority=*/1);
    // SetCPUAllocator ignores an allocator of lower priority than the installed one: check that it took.
    g_counting = c10::GetCPUAllocator() == &counting;
  });
  return method();
}

// Installed before main() wherever the meter is linked, so that the model's weights and every later tensor are
// counted; c10 registers its default allocator in its own shared library, whose initializers run before ours.
namespace {
[[maybe_unused]] const bool g_installed_at_startup = [] {
  MemoryMeter::install();
  return true;
}();
}  // namespace

std::string MemoryMeter::method() { return g_counting ? "counting-allocator" : "process-high-water-mark"; }

int64_t MemoryMeter::current_bytes() {
  return g_counting ? g_current.load(std::memory_order_relaxed) : process_resident_bytes();
}

int64_t MemoryMeter::peak_bytes() {
  return g_counting ? g_peak.load(std::memory_order_relaxed) : process_high_water_mark_bytes();
}

void MemoryMeter::reset_peak() {
  if (g_counting) {
    g_peak.store(g_current.load(std::memory_order_relaxed), std::memory_order_relaxed);
    return;
  }
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  if (!clear) {
    throw std::runtime_error("memory meter: cannot reset the high-water mark (writing 5 to /proc/self/clear_refs "
                             "failed)");
  }
}

}  // namespace dcp
