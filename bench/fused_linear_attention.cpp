// The fused linear-attention kernel alone (include/dcp/linear_attention.h), forward and backward timed
// separately on one sequence, without autograd or the model around it: the harness for profiling the kernel
// (`perf record build/bench/bench_fused_linear_attention ...`) and for quick before/after comparisons. The
// numbers of record come from `dcp bench-attention` (docs/flexformer.md "Performance").
//
//   build/bench/bench_fused_linear_attention --length 16384 --map stationary --dtype fp32 --reps 5
//
// Prints the median forward and backward seconds over --reps runs after --warmups untimed ones, and the rate of
// the FLOPs the bench-attention report credits (the chunked form's cost model: forward A = H L (2 C F' + 2 C D' +
// 4 F' D' + 4 P D) with F' = F + 1, D' = D + 1, backward 2 A), where F is 2m (trig maps) or D (elu), P the
// frequency rows. The forward and backward are called directly (fused_linear_attention_forward / _backward).
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/torch.h>

#include <malloc.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <string>
#include <vector>

#include "dcp/linear_attention.h"
#include "util/stats.h"

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("The fused linear-attention kernel's forward and backward on one sequence");
  int64_t length = 16384, heads = 4, head_dim = 64, m = 64, chunk = 64, reps = 5, warmups = 1, threads = 1;
  std::string map_name = "stationary", dtype_name = "fp32", path_name = "auto";
  app.add_option("--length", length, "tokens of the one sequence")->check(CLI::Range(int64_t{1}, int64_t{1} << 26));
  app.add_option("--heads", heads, "heads")->check(CLI::Range(1, 1024));
  app.add_option("--head-dim", head_dim, "dimension per head")->check(CLI::Range(1, 1024));
  app.add_option("--num-features", m, "frequencies per head (trig maps)")->check(CLI::Range(1, 4096));
  app.add_option("--chunk-size", chunk, "tokens per chunk")->check(CLI::Range(1, 4096));
  app.add_option("--map", map_name, "stationary | nonstationary | fixed | elu")
      ->check(CLI::IsMember({"stationary", "nonstationary", "fixed", "elu"}));
  app.add_option("--dtype", dtype_name, "fp32 | bf16")->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--path", path_name, "auto | portable | avx512 | avx512-bf16 | amx")
      ->check(CLI::IsMember({"auto", "portable", "avx512", "avx512-bf16", "amx"}));
  app.add_option("--reps", reps, "timed runs after the warm-ups (median)")->check(CLI::Range(1, 10000));
  app.add_option("--warmups", warmups, "untimed runs first (the heap grows for a few runs before it settles)")
      ->check(CLI::Range(0, 10000));
  app.add_option("--threads", threads, "intra-op threads")->check(CLI::Range(1, 1024));
  bool fresh_pages = false, faults = false;
  app.add_flag("--faults", faults, "print the process's minor page faults after each run (fresh pages show there)");
  app.add_flag("--fresh-pages", fresh_pages, "keep glibc's default mmap threshold (large outputs fault their pages in "
                                             "on every run) instead of the dcp binary's setting");
  CLI11_PARSE(app, argc, argv);
  if (!fresh_pages) {  // as src/cli/host_memory.h does for the dcp binary
    mallopt(M_MMAP_THRESHOLD, 1 << 30);
    mallopt(M_TRIM_THRESHOLD, INT_MAX);
  }
  torch::set_num_threads(static_cast<int>(threads));
  torch::manual_seed(1);
  torch::NoGradGuard no_grad;

  const auto dtype = dtype_name == "bf16" ? torch::kBFloat16 : torch::kFloat;
  const std::vector<std::string> paths = {"auto", "portable", "avx512", "avx512-bf16", "amx"};
  dcp::FusedLinearAttentionOptions options;
  options.chunk_size = chunk;
  options.path = static_cast<dcp::LinearAttentionPath>(
      std::find(paths.begin(), paths.end(), path_name) - paths.begin());
  dcp::FusedFeatureMap map;
  map.feature_map = map_name == "stationary"      ? dcp::FeatureMap::kStationary
                    : map_name == "nonstationary" ? dcp::FeatureMap::kNonstationary
                    : map_name == "fixed"         ? dcp::FeatureMap::kFixed
                                                  : dcp::FeatureMap::kElu;
  const bool trig = map.feature_map != dcp::FeatureMap::kElu;
  const bool pair = map.feature_map == dcp::FeatureMap::kNonstationary;
  if (trig) map.omega = torch::randn({heads, m, head_dim});
  if (pair) map.omega2 = torch::randn({heads, m, head_dim});
  map.alpha = torch::full({heads}, 1.5);
  const auto q = torch::randn({length, heads, head_dim}).to(dtype);
  const auto k = torch::randn({length, heads, head_dim}).to(dtype);
  const auto v = torch::randn({length, heads, head_dim}).to(dtype);
  const auto g = torch::randn({length, heads, head_dim}).to(dtype);
  const auto cu = torch::tensor({int64_t{0}, length}, torch::kInt64);

  std::vector<double> fwd, bwd;
  for (int64_t r = 0; r < warmups + reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    const dcp::FusedLinearAttentionResult res = dcp::fused_linear_attention_forward(q, k, v, cu, map, options);
    const double f = seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
    const dcp::FusedLinearAttentionGrads grads =
        dcp::fused_linear_attention_backward(g, q, k, v, res, cu, map, options);
    const double b = seconds_since(t0);
    {
      rusage u{};
      getrusage(RUSAGE_SELF, &u);
      if (faults) fmt::print("after run {}: {} minor page faults in all\n", r, u.ru_minflt);
    }
    if (r >= warmups) {
      fwd.push_back(f);
      bwd.push_back(b);
    }
  }
  const double F = trig ? 2.0 * m + 1 : head_dim + 1.0, D = head_dim + 1.0, C = static_cast<double>(chunk);
  const double P = trig ? (pair ? 2.0 * m : static_cast<double>(m)) : 0.0;
  const double a = static_cast<double>(heads * length) *
                   (2 * C * F + 2 * C * D + 4 * F * D + 4 * P * static_cast<double>(head_dim));
  const double tf = dcp::median(fwd), tb = dcp::median(bwd);
  fmt::print("{} {} L {} heads {} head_dim {} m {} chunk {} path {} threads {}: forward {:.2f} ms ({:.1f} GFLOP/s), "
             "backward {:.2f} ms ({:.1f} GFLOP/s), total {:.2f} ms ({:.1f} GFLOP/s credited)\n",
             map_name, dtype_name, length, heads, head_dim, trig ? m : 0, chunk, path_name, threads, tf * 1e3,
             a / tf * 1e-9, tb * 1e3, 2 * a / tb * 1e-9, (tf + tb) * 1e3, 3 * a / (tf + tb) * 1e-9);
  return 0;
}
