// `dcp profile`: fit the CostModel's time terms and a MemoryModel to forward+backward timings and peak bytes of
// the configured model on the CPU; under `dcp launch`, also the all-to-alls of every SP group and a check of
// real SP micro-batches against the fit.
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

namespace dcp {

namespace {

void print_report(const Config& cfg, const ProfileOptions& options, const ProfileResult& r,
                  const std::string& out_path) {
  fmt::print("model d_model {} n_layers {} n_heads {} d_ff {}; precision {}; {} rank(s) x {} threads, median of "
             "{} runs after a warm-up (the warm-up alone where it took over {:g} s)\n\n",
             cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads, cfg.model.d_ff,
             resolve_precision(cfg.train.precision).describe(), r.world_size, r.threads, r.repeats,
             options.long_point_s);
  fmt::print("| sample_length | samples | tokens | recompute | measured_ms | predicted_ms | error | measured_MB | "
             "predicted_MB | error | held_out |\n");
  fmt::print("|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const ProfilePoint& p : r.points) {
    fmt::print("| {} | {} | {} | {} | {:.1f} | {:.1f} | {:+.1f}% | {:.1f} | {:.1f} | {:+.1f}% | {} |\n",
               p.lengths.front(), p.lengths.size(), p.tokens, p.recompute_layers, 1e3 * p.measured_s,
               1e3 * p.predicted_s, 100.0 * (p.predicted_s - p.measured_s) / p.measured_s,
               p.measured_peak_bytes / 1e6, p.predicted_peak_bytes / 1e6,
               100.0 * (p.predicted_peak_bytes - p.measured_peak_bytes) / p.measured_peak_bytes,
               p.held_out ? "yes" : "");
  }
  fmt::print("\nfit: fixed {:.2f} ms, linear {:.2f} GFLOP/s, attention {:.2f} GFLOP/s (attention_mfu {:.3f})\n",
             1e3 * r.fixed_s, r.linear_flops_per_s / 1e9, r.attention_flops_per_s / 1e9, r.device.attention_mfu);
  if (!r.attention_separated) {
    fmt::print("(the grid did not separate attention from the linear FLOPs: one rate fitted to both)\n");
  }
  fmt::print("held-out relative error: median {:.1f}%, max {:.1f}% ({} points); fitted points median {:.1f}%\n",
             100.0 * r.heldout_median_error, 100.0 * r.heldout_max_error,
             std::count_if(r.points.begin(), r.points.end(), [](const ProfilePoint& p) { return p.held_out; }),
             100.0 * r.fit_median_error);
  const MemoryCoefficients& m = r.memory;
  fmt::print("\nmemory fit ({}): base {:.2f} MB; per token and layer {:.0f} B kept, {:.0f} B recomputed; per "
             "squared token {:.2f} B per kept layer + {:.2f} B\n",
             r.memory_method, m.base_bytes / 1e6, m.token_layer_bytes, m.token_recompute_bytes,
             m.square_layer_bytes, m.square_bytes);
  fmt::print("memory held-out relative error: median {:.1f}%, max {:.1f}%; fitted points median {:.1f}%\n",
             100.0 * r.memory_heldout_median_error, 100.0 * r.memory_heldout_max_error,
             100.0 * r.memory_fit_median_error);
  if (!r.sequence_parallel.empty()) {
    fmt::print("\nall-to-all fits: seconds per call = latency + bytes leaving a rank / bandwidth; in a micro-batch "
               "each byte a rank exchanges costs the overhead more (fitted to the SP micro-batches below):\n\n");
    fmt::print("| sp | latency_us | GB/s | held-out median | held-out max | fitted median | calls timed | overhead_ns_per_B "
               "| micro-batch held-out median | max |\n");
    fmt::print("|---|---|---|---|---|---|---|---|---|---|\n");
    for (const SpProfile& c : r.sequence_parallel) {
      fmt::print("| {} | {:.1f} | {:.3f} | {:.1f}% | {:.1f}% | {:.1f}% | {} | {:.2f} | {:.1f}% | {:.1f}% |\n", c.sp_size,
                 1e6 * c.fit.latency_s, c.fit.bytes_per_s / 1e9, 100.0 * c.heldout_median_error,
                 100.0 * c.heldout_max_error, 100.0 * c.fit_median_error, c.points.size(),
                 1e9 * c.fit.overhead_s_per_byte, 100.0 * c.validation_heldout_median_error,
                 100.0 * c.validation_heldout_max_error);
    }
    for (const SpProfile& c : r.sequence_parallel) {
      if (!c.bandwidth_fitted) {
        fmt::print("(sp {}: the call times did not grow with the bytes; its GB/s is the fastest measured rate and "
                   "only the latency was fitted)\n",
                   c.sp_size);
      }
    }
    fmt::print("\nSP micro-batches against the fitted models:\n\n");
    fmt::print("| sp | sample_length | samples | recompute | measured_ms | predicted_ms | error | measured_MB | "
               "predicted_MB | error | held_out |\n");
    fmt::print("|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const ValidationPoint& p : r.validation) {
      fmt::print("| {} | {} | {} | {} | {:.1f} | {:.1f} | {:+.1f}% | {:.1f} | {:.1f} | {:+.1f}% | {} |\n", p.sp_size,
                 p.lengths.front(), p.lengths.size(), p.recompute_layers, 1e3 * p.measured_s, 1e3 * p.predicted_s,
                 100.0 * (p.predicted_s - p.measured_s) / p.measured_s, p.measured_peak_bytes / 1e6,
                 p.predicted_peak_bytes / 1e6,
                 100.0 * (p.predicted_peak_bytes - p.measured_peak_bytes) / p.measured_peak_bytes,
                 p.held_out ? "yes" : "");
    }
  }
  fmt::print("\nprofile took {:.1f} s; max RSS {:.1f} MB; wrote {} (train.cost_model / --cost-model read it)\n",
             r.wall_s, r.max_rss_bytes / 1e6, out_path);
}

// --max-length (or data.max_seq_len, its default) against the range the grids need, before anything runs:
// profile_model would refuse it only after the process groups are made.
void check_max_length(const ProfileOptions& options, const Config& cfg, const DistEnv& env) {
  const int64_t shortest = min_profile_max_length(cfg, env.world_size);
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
    print_report(cfg, *options, r, *out_path);
  });
}

}  // namespace dcp
