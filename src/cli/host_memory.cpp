#include "cli/host_memory.h"

#include <malloc.h>

#include <cstdlib>

namespace dcp {

bool keep_freed_memory() {
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"}) {
    if (std::getenv(name) != nullptr) return false;
  }
  return mallopt(M_MMAP_THRESHOLD, kKeptBlockBytes) == 1 && mallopt(M_TRIM_THRESHOLD, kKeptTopBytes) == 1;
}

}  // namespace dcp
