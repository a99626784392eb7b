// How the dcp process's C allocator keeps freed memory. glibc's malloc serves blocks above its mmap threshold
// (128 KB, raised on each free up to 32 MB) with fresh mmaps and gives them back on free, so every later tensor
// of that size faults each of its 4 KB pages in again on first touch. In the virtual machines dcp was measured on
// that costs about 4 ms per MB (bench/results/cpu2_202612_attention_fused_fp32_d64.md): at 32K tokens the fused
// linear-attention kernel spent more time faulting in its fresh output tensors than computing them.
#pragma once

#include <climits>

namespace dcp {

/// Sets glibc's M_MMAP_THRESHOLD to kKeptBlockBytes (1 GiB) and M_TRIM_THRESHOLD to kKeptTopBytes (2 GiB - 1, the
/// most mallopt's int can say), so that blocks up to 1 GiB come from the heap and freed ones stay there for the
/// next allocation (as a caching tensor allocator would keep them): once the heap has grown to a step's needs
/// (a few steps), a step touches no fresh pages. The cost is that the heap's freed memory
/// is not returned to the system until malloc_trim (which `dcp serve` calls when idle). Skipped when the
/// environment already sets either (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ or GLIBC_TUNABLES), so a
/// user's choice wins; returns whether it changed anything.
bool keep_freed_memory();

inline constexpr int kKeptBlockBytes = 1 << 30;
inline constexpr int kKeptTopBytes = INT_MAX;

}  // namespace dcp
