#include "dcp/cpu_features.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace dcp {
namespace {

CpuFeatures detect() {
  CpuFeatures f;
#if defined(__x86_64__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  // The OS must save the AVX-512 state (XCR0 bits 5-7 with SSE/AVX 1-2) or the instructions fault.
  __cpuid(1, eax, ebx, ecx, edx);
  const bool osxsave = (ecx >> 27) & 1;
  unsigned long long xcr0 = 0;
  if (osxsave) {
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (static_cast<unsigned long long>(hi) << 32) | lo;
  }
  const bool os_avx512 = (xcr0 & 0xe6) == 0xe6;
  __cpuid_count(7, 0, eax, ebx, ecx, edx);
  f.avx512f = os_avx512 && ((ebx >> 16) & 1);
  f.avx512bw = os_avx512 && ((ebx >> 30) & 1);
  f.avx512vl = os_avx512 && ((ebx >> 31) & 1);
  f.amx_bf16 = (edx >> 22) & 1;
  f.amx_tile = (edx >> 24) & 1;
  __cpuid_count(7, 1, eax, ebx, ecx, edx);
  f.avx512_bf16 = os_avx512 && ((eax >> 5) & 1);
#endif
  return f;
}

}  // namespace

std::string CpuFeatures::summary() const {
  std::string s;
  auto add = [&s](bool on, const char* name) {
    if (!on) return;
    if (!s.empty()) s += ' ';
    s += name;
  };
  add(avx512f, "avx512f");
  add(avx512bw, "avx512bw");
  add(avx512vl, "avx512vl");
  add(avx512_bf16, "avx512_bf16");
  add(amx_tile, "amx_tile");
  add(amx_bf16, "amx_bf16");
  return s.empty() ? "none" : s;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

bool amx_usable() {
  static const bool usable = [] {
    const CpuFeatures& f = cpu_features();
    if (!f.amx_tile || !f.amx_bf16 || !f.avx512bw || !f.avx512vl || !f.avx512_bf16) return false;
#if defined(__x86_64__) && defined(SYS_arch_prctl)
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
  }();
  return usable;
}

bool avx512_usable() {
  const CpuFeatures& f = cpu_features();
  return f.avx512f && f.avx512bw && f.avx512vl;
}

bool bf16_is_fast() {
  const CpuFeatures& f = cpu_features();
  return f.avx512_bf16 || amx_usable();
}

}  // namespace dcp
