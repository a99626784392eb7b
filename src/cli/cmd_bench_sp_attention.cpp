// `dcp bench-sp-attention`: one layer's sequence-parallel attention (Ulysses, ring, ulysses-ring) on one causal
// sequence over the ranks of `dcp launch`, against the whole sequence on one rank (src/train/sp_attention_bench.h).
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "cli/commands.h"
#include "dcp/cpu_features.h"
#include "dcp/dist.h"
#include "tools/bench_common.h"
#include "tools/sp_attention_bench.h"
#include "util/clock.h"

namespace fs = std::filesystem;

namespace dcp {
namespace {

struct Args {
  std::vector<int64_t> lengths{4096, 8192, 16384, 32768, 65536};
  std::vector<std::string> modes{"ulysses", "ring"};
  int64_t ulysses_size = 0;
  std::string dtype = "bf16";
  int64_t heads = 4, head_dim = 32, repetitions = 2, threads = 0;
  bool one_rank = true;
  std::string out, note;
  double timeout_s = 600;
};

void run(const Args& a) {
  const DistEnv env = DistEnv::from_environment();
  if (env.world_size < 2) {
    throw CLI::ValidationError("bench-sp-attention: run it under `dcp launch --nproc N -- dcp bench-sp-attention ...` "
                               "with N >= 2 (the SP group is every rank)");
  }
  SpAttentionBenchOptions o;
  o.lengths = a.lengths;
  std::sort(o.lengths.begin(), o.lengths.end());
  o.modes = a.modes;
  o.ulysses_size = a.ulysses_size;
  o.dtype = a.dtype;
  o.heads = a.heads;
  o.head_dim = a.head_dim;
  o.repetitions = a.repetitions;
  o.one_rank = a.one_rank;
  const int64_t threads = a.threads > 0 ? a.threads
                                        : std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()) /
                                                                   env.local_world_size);
  try {  // usage errors before the groups and the work, on every rank alike
    check_sp_attention_bench(o, env.world_size);
  } catch (const std::invalid_argument& e) {
    throw CLI::ValidationError(e.what());
  }
  const fs::path prefix = a.out.empty() ? fs::path(fmt::format("bench/results/cpu{}_{}_sp_attention",
                                                               std::thread::hardware_concurrency(), utc_now("%Y%m")))
                                        : fs::path(a.out);
  if (!prefix.has_filename()) {
    throw CLI::ValidationError(fmt::format("--out '{}': needs a file name stem after the folder (e.g. {}sp_attention)",
                                           a.out, a.out));
  }
  const fs::path md = prefix.string() + ".md", csv = prefix.string() + ".csv";
  if (env.rank == 0) {  // an unwritable --out fails now, not after the measurements
    std::error_code ec;
    if (prefix.has_parent_path()) fs::create_directories(prefix.parent_path(), ec);
    const bool existed = fs::exists(csv);
    const bool writable = !ec && std::ofstream(csv, std::ios::app).good();
    if (!existed && writable) fs::remove(csv);
    if (!writable) {
      throw CLI::ValidationError(fmt::format("--out '{}': cannot write '{}'{}", a.out, csv.string(),
                                             ec ? ": " + ec.message() : std::string()));
    }
  }
  torch::set_num_threads(static_cast<int>(threads));
  ProcessGroups groups(env, a.timeout_s, resolve_sp_sizes("all", env.world_size));
  const std::string date = utc_now("%Y-%m-%d %H:%M");
  const double load_start = load_average_1min();
  const auto start = std::chrono::steady_clock::now();
  const auto points = bench_sp_attention(o, groups);
  const double wall = seconds_since(start);
  if (env.rank != 0) return;
  for (const auto& p : points) {
    fmt::print("{:>6} {:<12} fwd {:8.3f} s  bwd {:8.3f} s  fwd+bwd {:8.3f} s  transfers alone {:7.3f} s ({:.1f} MB)\n",
               p.length, p.mode, p.forward_seconds, p.backward_seconds, p.seconds, p.comm_seconds, p.comm_bytes / 1e6);
  }
  write_text(md, sp_attention_bench_markdown(o, points, env.world_size, threads, date, load_start,
                                             load_average_1min(), wall, a.note));
  write_text(csv, sp_attention_bench_csv(points));
  fmt::print("wrote {}.md and {}.csv\n", prefix.string(), prefix.string());
}

}  // namespace

void add_bench_sp_attention_command(CLI::App& app) {
  auto a = std::make_shared<Args>();
  auto* sub = app.add_subcommand("bench-sp-attention",
                                 "Time one layer's sequence-parallel attention (ulysses, ring, ulysses-ring) over the "
                                 "ranks of `dcp launch` against one rank (docs/sequence_parallel.md)");
  sub->add_option("--lengths", a->lengths, "comma-separated sequence lengths, tokens (>= 2 x ranks)")
      ->delimiter(',')
      ->check(CLI::Range(int64_t{2}, int64_t{1} << 26))
      ->capture_default_str();
  sub->add_option("--modes", a->modes, "comma-separated sp modes: ulysses, ring, ulysses-ring")
      ->delimiter(',')
      ->check(CLI::IsMember({"ulysses", "ring", "ulysses-ring"}))
      ->capture_default_str();
  sub->add_option("--ulysses-size", a->ulysses_size, "ulysses-ring: ranks per Ulysses subgroup (0 = the largest)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  sub->add_option("--dtype", a->dtype, "fp32 or bf16")->check(CLI::IsMember({"fp32", "bf16"}))->capture_default_str();
  sub->add_option("--heads", a->heads, "attention heads")->check(CLI::Range(int64_t{1}, int64_t{4096}))->capture_default_str();
  sub->add_option("--head-dim", a->head_dim, "dimension per head")->check(CLI::Range(int64_t{1}, int64_t{4096}))->capture_default_str();
  sub->add_option("--repetitions", a->repetitions, "timed runs per point after one warm-up (median)")
      ->check(CLI::Range(int64_t{1}, int64_t{1000}))
      ->capture_default_str();
  sub->add_option("--threads", a->threads, "intra-op threads per rank (default: hardware threads / local ranks)")
      ->check(CLI::Range(int64_t{0}, int64_t{1024}));
  sub->add_flag("!--no-one-rank", a->one_rank, "skip the one-rank reference (and the efficiency column)");
  sub->add_option("--out", a->out, "path prefix of the .md and .csv results (default bench/results/cpu<cores>_<yyyymm>_sp_attention)");
  sub->add_option("--note", a->note, "a sentence added to the report's machine line");
  sub->add_option("--timeout", a->timeout_s, "rendezvous and collective timeout, seconds")
      ->check(finite_number_validator("seconds", 0.1, false, 86400));
  sub->callback([a] { run(*a); });
}

}  // namespace dcp
