#include "cli/blas_cores.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "dcp/cpu_features.h"

namespace dcp {

void ensure_openblas_kernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr || !avx512_usable()) return;
  using Corename = char* (*)();
  const auto corename = reinterpret_cast<Corename>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  if (corename == nullptr) return;  // another BLAS
  const char* core = corename();
  if (core == nullptr || std::strcmp(core, "Prescott") != 0) return;
  setenv("OPENBLAS_CORETYPE", cpu_features().avx512_bf16 ? "Cooperlake" : "SkylakeX", 1);
  execv("/proc/self/exe", argv);
}

void ensure_passive_openmp_for_serving(int argc, char** argv) {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  for (int i = 1; i < argc; ++i) {
    if (argv[i][0] == '-') continue;
    if (std::strcmp(argv[i], "serve") != 0 && std::strcmp(argv[i], "bench-serve") != 0) return;
    setenv("OMP_WAIT_POLICY", "passive", 1);
    execv("/proc/self/exe", argv);
    return;
  }
}

}  // namespace dcp
