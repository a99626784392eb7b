// `dcp profile`'s report on stdout (src/tools/profile_report.h).
#include "tools/profile_report.h"

#include <fmt/format.h>

#include <algorithm>

#include "dcp/precision.h"

namespace dcp {

void print_profile_report(const ModelConfig& model, const std::string& precision, const ProfileOptions& options,
                          const ProfileResult& r,
                  const std::string& out_path) {
  fmt::print("model d_model {} n_layers {} n_heads {} d_ff {}; precision {}; {} rank(s) x {} threads, median of "
             "{} runs after a warm-up (the warm-up alone where it took over {:g} s)\n\n",
             model.d_model, model.n_layers, model.n_heads, model.d_ff, precision, r.world_size, r.threads, r.repeats,
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

}  // namespace dcp
