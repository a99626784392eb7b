// `dcp profile`: fit the CostModel's time terms and a MemoryModel to forward+backward timings and peak bytes of
// the configured model on the CPU; under `dcp launch`, also the all-to-alls of every SP group and a check of
// real SP micro-batches against the fit. Its options; the profiler is profile/profiler.h, the report
// tools/profile_report.h.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>

#include "cli/commands.h"
#include "dcp/dist.h"
#include "dcp/precision.h"
#include "profile/profiler.h"
#include "tools/profile_report.h"

namespace dcp {

namespace {

// --max-length (or data.max_seq_len, its default) against the range the grids need, before anything runs:
// profile_model would refuse it only after the process groups are made.
void check_max_length(const ProfileOptions& options, const Config& cfg, const DistEnv& env) {
  const int64_t shortest = min_profile_max_length(cfg.parallel, cfg.model, env.world_size);
  const int64_t length = options.max_length > 0 ? options.max_length : cfg.data.max_seq_len;
  if (length >= shortest && length <= cfg.data.max_seq_len) return;
  throw CLI::ValidationError(fmt::format(
      "{} {}: outside the allowed range [{}, {}] (the lower bound: three distinct grid lengths, max_length, / 2 "
      "and / 4, and SP validation lengths that are multiples of the largest SP size profiled; the upper: "
      "data.max_seq_len, the longest sample the trainer makes, raise it to profile longer ones)",
      options.max_length > 0 ? "--max-length" : "data.max_seq_len (the default --max-length)", length, shortest,
      cfg.data.max_seq_len));
}

}  // namespace

void add_profile_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "profile", "Time and measure the configured model on this CPU and fit time and memory models to it");
  auto config_path = std::make_shared<std::string>();
  auto out_path = std::make_shared<std::string>();
  auto options = std::make_shared<ProfileOptions>();
  sub->add_option("--config", *config_path, "YAML config file whose model (and train.threads, data.max_seq_len, "
                                            "parallel.sp_sizes, run.seed) is profiled")
      ->check(CLI::ExistingFile);
  sub->add_option("--out", *out_path, "profile JSON to write (by rank 0); --cost-model FILE reads it")->required();
  sub->add_option("--repeats", options->repeats, "timed runs per grid point (median), after one warm-up")
      ->check(CLI::Range(1, 1000));
  sub->add_option("--max-length", options->max_length,
                  "longest sample of the grids, tokens (default: data.max_seq_len; at least 4 and the largest SP "
                  "size profiled, at most data.max_seq_len)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  sub->allow_extras();
  sub->footer("Grid: sample lengths --max-length, / 4, / 16, ... down to 128 (or --max-length, / 2, / 4 when that "
              "gives fewer than three) x micro-batches of ~T/8 and ~T tokens "
              "(T = max(--max-length, train.micro_batch_tokens)) x recompute_layers 0 and n_layers; one warm-up, "
              "then the median of --repeats runs (the warm-up alone when it took over 1 s); every 4th point is "
              "held out of the "
              "fit and its relative error reported, for time and for peak memory (tensor storage counted by the CPU "
              "allocator, with the trainer's weights, gradients and AdamW moments resident). Under `dcp launch "
              "--nproc N` every rank runs the grid at once with cores / N threads (train.threads), times are "
              "averaged over the ranks before the fit, and for every SP size of parallel.sp_sizes above 1 that "
              "divides n_heads (the others are named in a warning) the Ulysses all-to-alls are timed on the real "
              "group and fitted as latency + bytes / bandwidth (every 3rd call held out; times that do not grow "
              "with the bytes get a latency-only fit and a warning); then real SP micro-batches of samples of "
              "max_length / 16, / 8, / 4, / 2 and / 1 tokens (~T/8 tokens or one sample) x recompute 0 and n_layers are timed, a per-byte overhead of the "
              "exchanges inside a micro-batch is fitted to alternate ones and the others are held out. Without "
              "`dcp launch` SP is not profiled (the cost model keeps its default latency and bandwidths). Config "
              "keys can be overridden as --section.key=value.");
  sub->callback([sub, config_path, out_path, options] {
    const Config cfg = Config::load(*config_path, config_overrides(*sub));
    const DistEnv env = DistEnv::from_environment();
    check_max_length(*options, cfg, env);
    if (env.rank == 0) {  // profiling takes a while: find an unwritable --out before (and leave no empty file)
      const bool existed = std::filesystem::exists(*out_path);
      const bool writable = !out_path->empty() && std::ofstream(*out_path, std::ios::app).good();
      if (!existed && writable) std::filesystem::remove(*out_path);
      if (!writable) throw CLI::ValidationError(fmt::format("--out '{}': cannot write this file", *out_path));
    }
    std::optional<ProcessGroups> groups;
    if (env.world_size > 1) groups.emplace(env, cfg.dist.timeout_s, resolve_sp_sizes(cfg.parallel.sp_sizes, env.world_size));
    const ProfileResult r = profile_model(cfg, groups ? &*groups : nullptr, *options);
    if (env.rank != 0) return;
    write_profile(r, *out_path);
    print_profile_report(cfg.model, resolve_precision(cfg.train.precision).describe(), *options, r, *out_path);
  });
}

}  // namespace dcp
