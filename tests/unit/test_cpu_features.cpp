#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "dcp/cpu_features.h"

namespace dcp {
namespace {

// The kernel's own reading of CPUID: the "flags" line of /proc/cpuinfo (Linux only).
std::set<std::string> proc_cpuinfo_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::set<std::string> flags;
    for (std::string w; words >> w;) flags.insert(w);
    return flags;
  }
  return {};
}

TEST(CpuFeatures, AgreesWithProcCpuinfo) {
  const auto flags = proc_cpuinfo_flags();
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags on this system";
  const CpuFeatures& f = cpu_features();
  EXPECT_EQ(f.avx512f, flags.count("avx512f") == 1);
  EXPECT_EQ(f.avx512bw, flags.count("avx512bw") == 1);
  EXPECT_EQ(f.avx512vl, flags.count("avx512vl") == 1);
  EXPECT_EQ(f.avx512_bf16, flags.count("avx512_bf16") == 1);
  EXPECT_EQ(f.amx_tile, flags.count("amx_tile") == 1);
  EXPECT_EQ(f.amx_bf16, flags.count("amx_bf16") == 1);
}

TEST(CpuFeatures, SummaryNamesWhatIsPresent) {
  CpuFeatures none;
  EXPECT_EQ(none.summary(), "none");
  CpuFeatures some;
  some.avx512f = true;
  some.amx_bf16 = true;
  EXPECT_EQ(some.summary(), "avx512f amx_bf16");
}

TEST(CpuFeatures, AmxUsableOnlyWithTheInstructions) {
  const CpuFeatures& f = cpu_features();
  if (!f.amx_tile || !f.amx_bf16) EXPECT_FALSE(amx_usable());
  EXPECT_EQ(bf16_is_fast(), f.avx512_bf16 || amx_usable());
}

}  // namespace
}  // namespace dcp
