// The scheduler's decode step alone, without HTTP: S sessions of a randomly initialised model (speed does not
// depend on the weights), each prefilled to its own cache length, then decoded (a) together by
// DecodeSession::step_batch as dcp serve's batched scheduler runs a decode-only iteration (its operations on one
// thread, the decode kernel on `--threads`), and (b) one after another, each alone in a step_batch of one session,
// as the scheduler runs the sequential run of dcp bench-serve. Prints the median seconds per step and tokens/s of
// both and their ratio, and the decode kernel alone (kv_decode_attention on the same caches, every path this CPU
// has) in GB/s against a streaming read peak measured in the same run. The profiling harness of docs/serve.md
// "Scheduler"; the numbers of record come from dcp bench-serve. `--precision auto` (the default) picks the
// precision a checkpoint trained here has (train.precision auto: bf16 only where the CPU has AVX512-BF16 or
// AMX-BF16), so that the harness compares with dcp serve like for like; before 2026-12-07 the default was bf16,
// which on a CPU without them timed caches of half the bytes the server held (cpu2_202612_serve_write_phase.md).
//
//   build/bench/bench_serve_step --sessions 16 --min-length 1024 --max-length 8192 --steps 64 --threads 2
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "dcp/infer.h"
#include "dcp/precision.h"
#include "util/stats.h"

namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// The streaming read rate of this machine: `threads` threads each summing its share of a buffer of `bytes` (8-byte
// words, four independent sums), best of 5 passes after one warm-up, in GB/s: the peak the decode kernel, which
// reads each session's cache once per step, is compared with.
double read_peak_gbs(int64_t bytes, int64_t threads) {
  const auto words = static_cast<size_t>(bytes / 8 / 4 * 4);
  std::vector<uint64_t> buf(words);
  for (size_t i = 0; i < words; ++i) buf[i] = i * 0x9E3779B97F4A7C15ull;
  std::vector<uint64_t> sink(static_cast<size_t>(threads));
  double best = 0;
  for (int pass = 0; pass < 6; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (int64_t t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        const size_t lo = words / static_cast<size_t>(threads) * static_cast<size_t>(t) / 4 * 4;
        const size_t hi = t + 1 == threads ? words : words / static_cast<size_t>(threads) * static_cast<size_t>(t + 1) / 4 * 4;
        uint64_t a = 0, b = 0, c = 0, d = 0;
        for (size_t i = lo; i < hi; i += 4) {
          a += buf[i];
          b += buf[i + 1];
          c += buf[i + 2];
          d += buf[i + 3];
        }
        sink[static_cast<size_t>(t)] = a ^ b ^ c ^ d;
      });
    }
    for (auto& th : pool) th.join();
    const double s = seconds_since(t0);
    if (pass > 0) best = std::max(best, static_cast<double>(words * 8) / s / 1e9);
  }
  uint64_t x = 0;
  for (uint64_t v : sink) x ^= v;
  return x == 42 ? best + 1e-12 : best;  // the sums are used
}

}  // namespace

int run(int64_t sessions, int64_t min_length, int64_t max_length, int64_t steps, int64_t threads, int64_t d_model,
        int64_t layers, int64_t heads, int64_t chunk_tokens, const dcp::PrecisionChoice& precision,
        bool skip_sequential) {
  torch::set_num_threads(static_cast<int>(threads));
  torch::manual_seed(1);
  dcp::ModelConfig mc;
  mc.d_model = d_model;
  mc.n_layers = layers;
  mc.n_heads = heads;
  mc.d_ff = 3 * d_model;
  dcp::Transformer model(mc, dcp::AttentionConfig{}, precision.precision);
  model->eval();
  torch::NoGradGuard no_grad;
  std::mt19937_64 rng(7);
  std::vector<std::unique_ptr<dcp::DecodeSession>> owned;
  std::vector<dcp::DecodeSession*> all;
  int64_t total_entries = 0, shortest = max_length;
  for (int64_t s = 0; s < sessions; ++s) {
    const int64_t length =
        sessions == 1 ? max_length : min_length + (max_length - min_length) * s / std::max<int64_t>(sessions - 1, 1);
    std::vector<int64_t> tokens{dcp::kBosToken};
    for (int64_t i = 1; i < length; ++i) tokens.push_back(static_cast<int64_t>(32 + rng() % 95));
    owned.push_back(std::make_unique<dcp::DecodeSession>(model, chunk_tokens));
    owned.back()->prefill(tokens);
    all.push_back(owned.back().get());
    total_entries += length;
    shortest = std::min(shortest, length);
  }
  const int restore = at::get_num_threads();
  std::vector<std::vector<int64_t>> next(static_cast<size_t>(sessions), std::vector<int64_t>{'a'});
  const std::vector<bool> decode_only(static_cast<size_t>(sessions), false);
  std::vector<double> batched;
  fmt::print(stderr, "bench_serve_step: {} sessions prefilled; timing {} batched decode steps\n", sessions, steps);
  for (int64_t step = -2; step < steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    omp_set_num_threads(1);  // as the scheduler: the step's operations on one thread, the kernel on `threads`
    const std::vector<torch::Tensor> logits = dcp::DecodeSession::step_batch(all, next, decode_only, threads);
    omp_set_num_threads(restore);
    for (size_t i = 0; i < logits.size(); ++i) next[i][0] = 32 + logits[i][0].slice(0, 32, 127).argmax().item<int64_t>();
    if (step >= 0) batched.push_back(seconds_since(t0));
  }
  const double b = dcp::median(batched);
  fmt::print("model d_model {} layers {} heads {} {}, {} thread(s); {} sessions, caches {}..{} tokens ({} in all)\n",
             d_model, layers, heads, precision.describe(), threads, sessions, shortest, max_length, total_entries);
  fmt::print("batched:    {:.3f} ms per step of {} sessions, {:.1f} tokens/s\n", 1e3 * b, sessions,
             static_cast<double>(sessions) / b);
  {
    // The decode kernel alone on the same caches, every layer, each path this CPU runs: its share of the step.
    const dcp::KvCacheSpec spec = all[0]->cache().spec();
    const int64_t hd = d_model / heads;
    const auto opts = torch::TensorOptions().dtype(spec.dtype);
    const torch::Tensor q = torch::randn({sessions, heads, hd}).to(opts), k = torch::randn({sessions, heads, hd}).to(opts),
                        v = torch::randn({sessions, heads, hd}).to(opts);
    std::vector<const dcp::KvCache*> caches;
    for (const auto* s : all) caches.push_back(&s->cache());
    // What the kernel reads per step: every entry's key, value (cache dtype) and bias (fp32), every layer.
    double cache_bytes = 0;
    const double per_entry = static_cast<double>((spec.head_dim + spec.value_dim) * static_cast<int64_t>(c10::elementSize(spec.dtype)) + 4);
    for (const auto* s : all) {
      for (int64_t layer = 0; layer < layers; ++layer) {
        for (int64_t h = 0; h < spec.kv_heads; ++h) cache_bytes += per_entry * static_cast<double>(s->cache().length(layer, h));
      }
    }
    const double peak = read_peak_gbs(std::max<int64_t>(static_cast<int64_t>(4 * cache_bytes), int64_t{1} << 28), threads);
    fmt::print("read peak  {:.1f} GB/s ({} threads streaming a buffer of 4x the caches, at least 256 MiB)\n", peak,
               threads);
    if (cache_bytes < 64.0 * (1 << 20)) {
      fmt::print("note: the caches hold {:.1f} MB, which the CPU's own caches may hold: the kernel's GB/s is then not "
                 "a memory rate and may exceed the read peak\n", cache_bytes / 1e6);
    }
    for (auto path : {dcp::DecodeAttentionPath::kPortable, dcp::DecodeAttentionPath::kAvx512,
                      dcp::DecodeAttentionPath::kAvx512Bf16}) {
      try {
        dcp::resolve_decode_attention_path(spec.dtype, path);
      } catch (const std::invalid_argument&) {
        continue;
      }
      std::vector<double> t;
      for (int64_t rep = -1; rep < 8; ++rep) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int64_t layer = 0; layer < layers; ++layer) dcp::kv_decode_attention(q, k, v, caches, layer, 0, path, threads);
        if (rep >= 0) t.push_back(seconds_since(t0));
      }
      const double m = dcp::median(t);
      fmt::print("kernel {:<11} {:.3f} ms per step (every layer), {:.1f} GB/s of cache read ({:.0f}% of the read peak), "
                 "{:.0f}% of the batched step\n",
                 dcp::to_string(path), 1e3 * m, cache_bytes / m / 1e9, 100 * cache_bytes / m / 1e9 / peak, 100 * m / b);
    }
  }
  if (skip_sequential) return 0;
  std::vector<double> sequential;
  for (int64_t step = -1; step < std::max<int64_t>(steps / 4, 2); ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t i = 0; i < all.size(); ++i) {
      // One session per step, as the scheduler runs a lone session (bench-serve's sequential run).
      omp_set_num_threads(1);
      const std::vector<torch::Tensor> l =
          dcp::DecodeSession::step_batch({all[i]}, {next[i]}, {false}, threads);
      omp_set_num_threads(restore);
      next[i][0] = 32 + l[0][0].slice(0, 32, 127).argmax().item<int64_t>();
    }
    if (step >= 0) sequential.push_back(seconds_since(t0));
  }
  const double q = dcp::median(sequential);
  fmt::print("sequential: {:.3f} ms per round of {} sessions, {:.1f} tokens/s\n", 1e3 * q, sessions,
             static_cast<double>(sessions) / q);
  fmt::print("batched / sequential tokens/s: {:.2f}x\n", q / b);
  return 0;
}

int main(int argc, char** argv) {
  CLI::App app("dcp serve's batched decode step against the same sessions decoded one after another");
  int64_t sessions = 16, min_length = 1024, max_length = 8192, steps = 64, threads = 2, d_model = 128, layers = 4,
          heads = 4, chunk_tokens = 512;
  std::string precision = "auto";
  bool skip_sequential = false;
  app.add_option("--sessions", sessions, "concurrent sessions")->check(CLI::Range(1, 4096));
  app.add_option("--min-length", min_length, "shortest cache, tokens")->check(CLI::Range(1, 1 << 24));
  app.add_option("--max-length", max_length, "longest cache, tokens (lengths evenly spaced)")->check(CLI::Range(1, 1 << 24));
  app.add_option("--steps", steps, "decode steps timed")->check(CLI::Range(1, 1 << 20));
  app.add_option("--threads", threads, "intra-op threads")->check(CLI::Range(1, 1024));
  app.add_option("--d-model", d_model, "model width")->check(CLI::Range(8, 1 << 16));
  app.add_option("--layers", layers, "layers")->check(CLI::Range(1, 1024));
  app.add_option("--heads", heads, "heads")->check(CLI::Range(1, 1024));
  app.add_option("--chunk-tokens", chunk_tokens, "prefill chunk")->check(CLI::Range(1, 1 << 24));
  app.add_option("--precision", precision,
                 "auto | fp32 | bf16 (auto: as train.precision auto resolves it, bf16 exactly where the CPU has "
                 "AVX512-BF16 or AMX-BF16, else fp32: the precision dcp serve's checkpoint trained on this machine has)")
      ->check(CLI::IsMember({"auto", "fp32", "bf16"}));
  app.add_flag("--skip-sequential", skip_sequential, "time the batched step only (for a profile)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help prints and exits 0; a bad option or value exits 2 with CLI11's message, as a bad range does below.
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (max_length < min_length) {
    fmt::print(stderr, "bench_serve_step: --max-length {} is below --min-length {}\n", max_length, min_length);
    return 2;
  }
  if (d_model % heads != 0 || (d_model / heads) % 2 != 0) {
    fmt::print(stderr, "bench_serve_step: --d-model {} / --heads {} must be a whole, even head dim (rotary pairs its "
               "columns)\n", d_model, heads);
    return 2;
  }
  try {
    return run(sessions, min_length, max_length, steps, threads, d_model, layers, heads, chunk_tokens,
               dcp::resolve_precision(precision), skip_sequential);
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_serve_step: {}\n", e.what());
    return 1;
  }
}
