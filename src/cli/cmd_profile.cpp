// `dcp profile`: fit the CostModel's time terms and a MemoryModel to forward+backward timings and peak bytes of
// the configured model on the CPU.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>

#include "cli/commands.h"
#include "dcp/precision.h"
#include "dcp/profiler.h"

namespace dcp {

void add_profile_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "profile", "Time and measure the configured model on this CPU and fit time and memory models to it");
  auto config_path = std::make_shared<std::string>();
  auto out_path = std::make_shared<std::string>();
  auto options = std::make_shared<ProfileOptions>();
  sub->add_option("--config", *config_path, "YAML config file whose model (and train.threads, data.max_seq_len, "
                                            "run.seed) is profiled")
      ->check(CLI::ExistingFile);
  sub->add_option("--out", *out_path, "profile JSON to write; --cost-model FILE reads it")->required();
  sub->add_option("--repeats", options->repeats, "timed runs per grid point (median), after one warm-up")
      ->check(CLI::Range(1, 1000));
  sub->allow_extras();
  sub->footer("Grid: sample lengths 64..1024 (up to data.max_seq_len) x micro-batches of ~1024 and ~4096 tokens x "
              "recompute_layers 0 and n_layers; every 4th point is held out of the fit and its relative error "
              "reported, for time and for peak memory (tensor storage counted by the CPU allocator, with the trainer's "
              "weights, gradients and AdamW moments resident). Sequence parallelism is not profiled (bandwidths "
              "keep their defaults; memory is assumed to divide by sp). Config keys can be overridden as "
              "--section.key=value.");
  sub->callback([sub, config_path, out_path, options] {
    const Config cfg = Config::load(*config_path, config_overrides(*sub));
    {  // profiling takes minutes: find an unwritable --out before, not after (and leave no empty file behind)
      const bool existed = std::filesystem::exists(*out_path);
      const bool writable = !out_path->empty() && std::ofstream(*out_path, std::ios::app).good();
      if (!existed && writable) std::filesystem::remove(*out_path);
      if (!writable) throw CLI::ValidationError(fmt::format("--out '{}': cannot write this file", *out_path));
    }
    const ProfileResult r = profile_model(cfg, *options);
    write_profile(r, *out_path);
    fmt::print("model d_model {} n_layers {} n_heads {} d_ff {}; precision {}; {} threads, median of {} runs after "
               "a warm-up\n\n",
               cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads, cfg.model.d_ff,
               resolve_precision(cfg.train.precision).describe(), r.threads, r.repeats);
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
    fmt::print("max RSS {:.1f} MB; wrote {} (train.cost_model / --cost-model read it)\n", r.max_rss_bytes / 1e6,
               *out_path);
  });
}

}  // namespace dcp
