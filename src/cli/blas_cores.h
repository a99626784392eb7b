// OpenBLAS chooses its kernels from the CPUID model when it loads; on CPUs it does not know (some virtual machines
// report a bare "Intel(R) Xeon(R) Processor") it falls back to the generic Prescott kernels, measured at 31 GFLOP/s
// for a 2048^3 fp32 matmul on one Sapphire Rapids core against 149 with the AVX-512 ones.
#pragma once

namespace dcp {

/// When OpenBLAS runs its Prescott kernels on a CPU with AVX-512 and OPENBLAS_CORETYPE is unset, sets it
/// (Cooperlake where AVX512-BF16 is present, else SkylakeX) and re-executes this program with the same argv,
/// since OpenBLAS reads the variable only when it loads. Returns normally otherwise (also when the re-exec
/// fails: the run then goes on with the slow kernels). Children started later inherit the variable.
void ensure_openblas_kernels(char** argv);

/// dcp serve and dcp bench-serve (the first argument that is not an option): when OMP_WAIT_POLICY is unset, sets it
/// to passive and re-executes this program with the same argv, since libgomp reads it only when it loads. By
/// default libgomp's idle threads spin (up to GOMP_SPINCOUNT iterations) after every parallel region; a server
/// runs many short regions per decode step beside its HTTP and client threads, and on a machine with fewer free
/// cores than runnable threads each spinning thread takes a core from the thread the region waits for (docs/serve.md
/// "Scheduler").
/// An OMP_WAIT_POLICY set by the user is kept. Returns normally otherwise (also when the re-exec fails).
void ensure_passive_openmp_for_serving(int argc, char** argv);

}  // namespace dcp
