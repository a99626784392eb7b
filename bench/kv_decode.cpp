// Decoding speed of a softmax model through the KV cache against recomputing the window for every token (what
// `dcp generate` did before the cache), greedy, on a randomly initialised model of the default shape (speed does
// not depend on the weights). Prints tokens per second of both, by wall time and by this process's CPU time (with
// one thread the CPU time is what the work took even on a machine other jobs share), and the cache's bytes.
//
//   build/bench/bench_kv_decode --new-tokens 1000 --prompt-tokens 24 --context 2048 --precision fp32 --threads 1
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <chrono>
#include <ctime>
#include <string>
#include <vector>

#include "dcp/infer.h"

namespace {

struct Stopwatch {
  std::chrono::steady_clock::time_point wall = std::chrono::steady_clock::now();
  std::clock_t cpu = std::clock();
  double wall_s() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - wall).count(); }
  double cpu_s() const { return static_cast<double>(std::clock() - cpu) / CLOCKS_PER_SEC; }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("KV-cache decoding against recomputing the window");
  int64_t new_tokens = 1000, prompt_tokens = 24, context = 2048, chunk_tokens = 512, threads = 1;
  std::string precision = "fp32";
  bool skip_recompute = false;
  app.add_option("--new-tokens", new_tokens, "tokens generated")->check(CLI::Range(1, 1 << 20));
  app.add_option("--prompt-tokens", prompt_tokens, "prompt length (random bytes)")->check(CLI::Range(0, 1 << 20));
  app.add_option("--context", context, "window the model sees")->check(CLI::Range(1, 1 << 24));
  app.add_option("--chunk-tokens", chunk_tokens, "prefill chunk")->check(CLI::Range(1, 1 << 24));
  app.add_option("--precision", precision, "fp32 | bf16")->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--threads", threads, "intra-op threads")->check(CLI::Range(1, 1024));
  app.add_flag("--skip-recompute", skip_recompute, "time the cached path only");
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(static_cast<int>(threads));
  torch::manual_seed(1);
  dcp::Transformer model(dcp::ModelConfig{}, dcp::AttentionConfig{},
                         precision == "bf16" ? dcp::Precision::kBf16 : dcp::Precision::kFp32);
  model->eval();
  torch::NoGradGuard no_grad;
  std::string prompt;
  for (int64_t i = 0; i < prompt_tokens; ++i) prompt.push_back(static_cast<char>('a' + i % 26));
  dcp::GenerateOptions opt;
  opt.max_new_tokens = new_tokens;
  opt.temperature = 0;
  opt.context = context;
  opt.chunk_tokens = chunk_tokens;
  Stopwatch cached_clock;
  const std::string cached = dcp::generate(model, prompt, opt);
  const double cached_s = cached_clock.wall_s(), cached_cpu = cached_clock.cpu_s();
  fmt::print("model d_model {} layers {} heads {}, {}, {} thread(s); prompt {} + {} new tokens, context {}\n",
             model->cfg.d_model, model->cfg.n_layers, model->cfg.n_heads, precision, threads, prompt_tokens,
             new_tokens, context);
  fmt::print("kv cache:  {:.2f} s wall, {:.1f} tokens/s; {:.2f} s CPU, {:.1f} tokens/CPU-s\n", cached_s,
             new_tokens / cached_s, cached_cpu, new_tokens / cached_cpu);
  {
    // The cache of the whole sequence, for its size.
    dcp::DecodeSession session(model, chunk_tokens);
    std::vector<int64_t> tokens{dcp::kBosToken};
    for (unsigned char c : prompt + cached) tokens.push_back(c);
    if (static_cast<int64_t>(tokens.size()) > context) tokens.resize(static_cast<size_t>(context));
    session.prefill(tokens);
    fmt::print("cache of {} tokens: {} bytes held, {} allocated\n", tokens.size(), session.cache().bytes(),
               session.cache().capacity_bytes());
  }
  if (skip_recompute) return 0;
  // The previous path: the whole window through the model for every token.
  Stopwatch recompute_clock;
  std::vector<int64_t> tokens{dcp::kBosToken};
  for (unsigned char c : prompt) tokens.push_back(c);
  std::string recomputed;
  for (int64_t i = 0; i < new_tokens; ++i) {
    const int64_t start = std::max<int64_t>(0, static_cast<int64_t>(tokens.size()) - context);
    const int64_t n = static_cast<int64_t>(tokens.size()) - start;
    dcp::PackedBatch b;
    b.tokens = torch::tensor(std::vector<int64_t>(tokens.begin() + start, tokens.end()), torch::kInt64);
    b.targets = torch::zeros({n}, torch::kInt64);
    b.positions = torch::arange(n, torch::kInt64);
    b.cu_seqlens = torch::tensor({int64_t{0}, n}, torch::kInt64);
    const int64_t next = model->forward(b)[n - 1].slice(0, 0, 256).argmax().item<int64_t>();
    tokens.push_back(next);
    recomputed.push_back(static_cast<char>(next));
  }
  const double recompute_s = recompute_clock.wall_s(), recompute_cpu = recompute_clock.cpu_s();
  fmt::print("recompute: {:.2f} s wall, {:.1f} tokens/s; {:.2f} s CPU, {:.1f} tokens/CPU-s\n", recompute_s,
             new_tokens / recompute_s, recompute_cpu, new_tokens / recompute_cpu);
  fmt::print("speedup {:.1f}x wall, {:.1f}x CPU; greedy outputs {}\n", recompute_s / cached_s,
             recompute_cpu / cached_cpu, cached == recomputed ? "identical" : "differ");
  return 0;
}
