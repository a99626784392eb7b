// A prefill chunk's attention over a KV cache, the two paths of kv_chunk_attention_append side by side
// (src/infer/cache_attention.cpp): kv_cache_attention (the cache converted to fp32 per key block, OpenBLAS matmuls,
// merged with the chunk's causal part by the tiled kernel) and kv_chunk_decode_attention (the chunk appended first,
// then each token by the decode kernel over the rows before it). It measured the decode-kernel path faster and so
// removed the former 64-token threshold between them on the AVX-512 paths; the serving scheduler's prefill budget
// runs chunks of 60-250 tokens over caches of 1-8K entries (bench/results/cpu2_202612_serve_chunk_paths.md).
//
//   build/bench/bench_chunk_attention --depths 1024 4096 8192 --tokens 32 64 128 256 512 --threads 2 --reps 7
//
// The decode-kernel path runs once per `--query-blocks` size (tokens per block of kv_chunk_decode_attention: 1 =
// token by token, each token rereading the head's rows; 16 = the default, rows read once per 16 tokens).
// Per (depth, tokens) it times the paths alternately `reps` times (median, ms per call and per token), on one
// layer of a bf16 cache with `heads` KV heads of `head_dim` (default: the serving benchmark's model, 4 heads of 32).
// --check also compares the outputs and exits 1 when the decode-kernel path differs from the matmul path by more
// than 1.6e-2 (the bf16 tolerance of KvDecodeAttention.AChunkAppendedFirstMatchesTheTwinOnEveryPath: a few bf16
// steps of outputs of magnitude ~1) or when two block sizes give different bits (they must not: each token's sums
// keep one order); CTest runs it so at tiny sizes (bench_chunk_attention_smoke).
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "dcp/infer.h"
#include "util/stats.h"

int main(int argc, char** argv) {
  CLI::App app{"A prefill chunk's attention over a KV cache: the matmul path against the decode-kernel path"};
  std::vector<int64_t> depths{1024, 4096, 8192}, tokens{32, 64, 128, 256, 512};
  std::vector<int64_t> blocks{1, dcp::kChunkQueryBlock};
  int64_t heads = 4, head_dim = 32, threads = 2, reps = 7;
  bool check = false;
  app.add_option("--depths", depths, "cache entries per head before the chunk")->check(CLI::Range(1, 1 << 24));
  app.add_option("--tokens", tokens, "chunk lengths")->check(CLI::Range(1, 1 << 16));
  app.add_option("--heads", heads, "KV heads (= query heads)")->check(CLI::Range(1, 1024));
  app.add_option("--head-dim", head_dim, "head dimension")->check(CLI::Range(1, 1024));
  app.add_option("--query-blocks", blocks, "tokens per block of the decode-kernel path, one run each")
      ->check(CLI::Range(1, 16));
  app.add_option("--threads", threads, "intra-op threads")->check(CLI::Range(1, 1024));
  app.add_option("--reps", reps, "alternations per point (median)")->check(CLI::Range(1, 1000));
  app.add_flag("--check", check,
               "exit 1 when the paths' outputs differ by more than 1.6e-2, or block sizes give different bits");
  CLI11_PARSE(app, argc, argv);
  double worst = 0;
  int64_t unequal = 0;
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
  std::string head = "| depth | tokens | matmul path ms", rule = "|---|---|---|";
  for (int64_t b : blocks) {
    head += fmt::format(" | decode path, {}-token blocks, ms | / matmul", b);
    rule += "---|---|";
  }
  fmt::print("{} |\n{}\n", head, rule);
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
      auto decode_path = [&](int64_t b) {
        return dcp::kv_chunk_decode_attention(q, k, v, after, 0, scale, dcp::DecodeAttentionPath::kAuto, threads, b);
      };
      if (check) {
        const torch::Tensor a = dcp::kv_cache_attention(q, k, v, before, 0, {}).out.to(torch::kFloat);
        const torch::Tensor first = decode_path(blocks.front());
        worst = std::max(worst, (a - first.to(torch::kFloat)).abs().max().item<double>());
        for (size_t i = 1; i < blocks.size(); ++i) {
          const int64_t b = blocks[i];
          if (!torch::equal(decode_path(b), first)) {
            ++unequal;
            fmt::print(stderr, "depth {} tokens {}: {}-token blocks gave other bits than {}-token blocks\n", n, t, b,
                       blocks.front());
          }
        }
      }
      std::vector<double> matmul;
      std::vector<std::vector<double>> decode(blocks.size());
      for (int64_t r = 0; r < reps + 1; ++r) {
        auto t0 = std::chrono::steady_clock::now();
        (void)dcp::kv_cache_attention(q, k, v, before, 0, {});
        const double m = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (r > 0) matmul.push_back(m);  // the first round warms up
        for (size_t i = 0; i < blocks.size(); ++i) {
          t0 = std::chrono::steady_clock::now();
          (void)decode_path(blocks[i]);
          const double x = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
          if (r > 0) decode[i].push_back(x);
        }
      }
      const double m = dcp::median(matmul);
      std::string row = fmt::format("| {} | {} | {:.3f} ({:.4f})", n, t, m, m / t);
      for (const auto& times : decode) {
        const double d = dcp::median(times);
        row += fmt::format(" | {:.3f} ({:.4f}) | {:.2f}x", d, d / t, d / m);
      }
      fmt::print("{} |\n", row);
    }
  }
  if (check) {
    fmt::print("largest difference between the two paths' outputs: {:.3g} (tolerance 1.6e-2); block sizes giving "
               "other bits: {}\n", worst, unequal);
    if (!(worst <= 1.6e-2) || unequal > 0) return 1;
  }
  return 0;
}
