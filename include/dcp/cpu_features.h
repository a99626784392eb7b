// What this CPU can run: the instruction sets that decide the fast paths (bf16 training, AMX attention tiles).
#pragma once

#include <string>

namespace dcp {

/// Instruction-set extensions read once from CPUID (x86-64; all false elsewhere), as reported to user space
/// (AMX also needs the kernel's permission for tile data: amx_usable()).
struct CpuFeatures {
  bool avx512f = false;     ///< AVX-512 Foundation (fp32 attention tiles)
  bool avx512bw = false;    ///< AVX-512 byte/word (bf16 conversions)
  bool avx512vl = false;    ///< AVX-512 on 256-bit registers (bf16 rows)
  bool avx512_bf16 = false; ///< AVX512-BF16: vcvtne2ps2bf16, vdpbf16ps
  bool amx_tile = false;    ///< AMX tile registers
  bool amx_bf16 = false;    ///< AMX bf16 tile multiply (tdpbf16ps)
  /// "avx512f avx512bw avx512vl avx512_bf16 amx_tile amx_bf16" (the extensions present), "none" when none is.
  std::string summary() const;
};

/// This CPU's features (computed once, thread-safe).
const CpuFeatures& cpu_features();

/// True when AMX bf16 tiles can run in this process: the CPU has amx_tile and amx_bf16 (and the AVX-512 subsets
/// the tiles' operand conversions use: bw, vl, bf16) and Linux granted the
/// tile-data permission (arch_prctl ARCH_REQ_XCOMP_PERM, Linux >= 5.16). Asked once per process; thread-safe.
bool amx_usable();

/// True when the AVX-512 subsets the fused elementwise kernels use (F, BW, VL) are there.
bool avx512_usable();

/// True when bf16 matmuls are this CPU's fast path (AVX512-BF16 or AMX-BF16): `train.precision: auto` then
/// trains in bf16.
bool bf16_is_fast();

}  // namespace dcp
