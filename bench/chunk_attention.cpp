// A prefill chunk's attention over a KV cache, the two paths of kv_chunk_attention_append side by side
// (src/infer/cache_attention.cpp): kv_cache_attention (the cache converted to fp32 per key block, OpenBLAS matmuls,
// merged with the chunk's causal part by the tiled kernel) and kv_chunk_decode_attention (the chunk appended first,
// then each token by the decode kernel over the rows before it). It measured the decode-kernel path faster and so
// removed the former 64-token threshold between them on the AVX-512 paths; the serving scheduler's prefill budget
// runs chunks of 60-250 tokens over caches of 1-8K entries (bench/results/cpu2_202612_serve_chunk_paths.md).
//
//   build/bench/bench_chunk_attention --depths 1024 4096 8192 --tokens 32 64 128 256 512 --threads 2 --reps 7
//
// Per (depth, tokens) it times both paths alternately `reps` times (median, ms per call and per token), on one
// layer of a bf16 cache with `heads` KV heads of `head_dim` (default: the serving benchmark's model, 4 heads of 32).
// --check also compares the two outputs and exits 1 when they differ by more than 1.6e-2 (the bf16 tolerance of
// KvDecodeAttention.AChunkAppendedFirstMatchesTheTwinOnEveryPath: a few bf16 steps of outputs of magnitude ~1);
// CTest runs it so at tiny sizes (bench_chunk_attention_smoke).
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <vector>

#include "dcp/infer.h"
#include "util/stats.h"

int main(int argc, char** argv) {
  CLI::App app{"A prefill chunk's attention over a KV cache: the matmul path against the decode-kernel path"};
  std::vector<int64_t> depths{1024, 4096, 8192}, tokens{32, 64, 128, 256, 512};
  int64_t heads = 4, head_dim = 32, threads = 2, reps = 7;
  bool check = false;
  app.add_option("--depths", depths, "cache entries per head before the chunk")->check(CLI::Range(1, 1 << 24));
  app.add_option("--tokens", tokens, "chunk lengths")->check(CLI::Range(1, 1 << 16));
  app.add_option("--heads", heads, "KV heads (= query heads)")->check(CLI::Range(1, 1024));
  app.add_option("--head-dim", head_dim, "head dimension")->check(CLI::Range(1, 1024));
  app.add_option("--threads", threads, "intra-op threads")->check(CLI::Range(1, 1024));
  app.add_option("--reps", reps, "alternations per point (median)")->check(CLI::Range(1, 1000));
  app.add_flag("--check", check, "exit 1 when the two paths' outputs differ by more than 1.6e-2");
  CLI11_PARSE(app, argc, argv);
  double worst = 0;
  at::set_num_threads(static_cast<int>(threads));
  torch::NoGradGuard no_grad;
  torch::manual_seed(0);
  const auto opt = torch::TensorOptions().dtype(torch::kBFloat16);
  dcp::KvCacheSpec spec;
  spec.layers = 1;
  spec.kv_heads = heads;
  spec.head_dim = head_dim;
  spec.value_dim = head_dim;
  spec.dtype = torch::kBFloat16;
  spec.device = torch::kCPU;
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  fmt::print("one layer, {} heads of {}, bf16, {} thread(s); ms per call (per token), median of {}\n", heads, head_dim,
             threads, reps);
  fmt::print("| depth | tokens | matmul path ms | decode-kernel path ms | decode / matmul |\n|---|---|---|---|---|\n");
  for (int64_t n : depths) {
    for (int64_t t : tokens) {
      dcp::KvCache before(spec), after(spec);
      const torch::Tensor ck = torch::randn({n, heads, head_dim}, opt), cv = torch::randn({n, heads, head_dim}, opt);
      const torch::Tensor pos = torch::arange(n, torch::kInt64);
      before.append(0, ck, cv, pos);
      after.append(0, ck, cv, pos);
      const torch::Tensor q = torch::randn({t, heads, head_dim}, opt), k = torch::randn({t, heads, head_dim}, opt),
                          v = torch::randn({t, heads, head_dim}, opt);
      after.append(0, k, v, torch::arange(n, n + t, torch::kInt64));
      if (check) {
        const torch::Tensor a = dcp::kv_cache_attention(q, k, v, before, 0, {}).out.to(torch::kFloat);
        const torch::Tensor b =
            dcp::kv_chunk_decode_attention(q, k, v, after, 0, scale, dcp::DecodeAttentionPath::kAuto, threads)
                .to(torch::kFloat);
        worst = std::max(worst, (a - b).abs().max().item<double>());
      }
      std::vector<double> matmul, decode;
      for (int64_t r = 0; r < reps + 1; ++r) {
        auto t0 = std::chrono::steady_clock::now();
        (void)dcp::kv_cache_attention(q, k, v, before, 0, {});
        auto t1 = std::chrono::steady_clock::now();
        (void)dcp::kv_chunk_decode_attention(q, k, v, after, 0, scale, dcp::DecodeAttentionPath::kAuto, threads);
        auto t2 = std::chrono::steady_clock::now();
        if (r == 0) continue;  // warm-up
        matmul.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        decode.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
      }
      const double m = dcp::median(matmul), d = dcp::median(decode);
      fmt::print("| {} | {} | {:.3f} ({:.4f}) | {:.3f} ({:.4f}) | {:.2f}x |\n", n, t, m, m / t, d, d / t, d / m);
    }
  }
  if (check) {
    fmt::print("largest difference between the two paths' outputs: {:.3g} (tolerance 1.6e-2)\n", worst);
    if (!(worst <= 1.6e-2)) return 1;
  }
  return 0;
}
