// `dcp bench`'s driver: train the same samples with several planners on real local processes, in alternating time
// slices (each slice a `dcp launch ... train --resume` child), then compare what they measured
// (tools/bench_report.h) in a markdown report, a CSV and a gnuplot PNG.
#include "tools/planner_bench.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <set>
#include <thread>

#include "tools/bench_common.h"
#include "tools/bench_report.h"

namespace fs = std::filesystem;

namespace dcp {
namespace {

std::string bench_markdown(const PlannerBench& opt, const Config& cfg, const std::vector<BenchRun>& runs,
                           const std::vector<BenchRow>& rows, const std::set<int64_t>& warmup, int64_t slice_steps,
                           int64_t slices, double load_start, double load_end, const std::string& png_name) {
  std::string md = fmt::format("# dcp bench: {} planners on {} processes\n\n", rows.size(), opt.nproc);
  md += fmt::format("Command:\n\n```\n{}\n```\n\n", own_command_line());
  md += fmt::format(
      "Machine: {} hardware threads, {} ranks, {} intra-op threads per rank; 1-minute load average {:.2f} at the "
      "start, {:.2f} at the end.\n\n",
      std::thread::hardware_concurrency(), opt.nproc, runs.front().threads_per_rank, load_start, load_end);
  md += fmt::format(
      "Each planner trains {} steps of {} tokens with seed {} (the same samples in every step, only their layout "
      "differs), config `{}` with the command's overrides, in {} slices of {} steps (one `dcp launch ... train --resume` each); the planners take turns "
      "slice by slice and the first planner rotates, so machine drift hits all alike. Model d_model {}, {} layers; data.max_seq_len {}; "
      "cost model `{}`, calibrated online (prediction x EMA of measured/predicted), so a run's first step has no "
      "prediction.\n\n",
      cfg.train.max_steps, cfg.train.global_batch_tokens, cfg.run.seed,
      opt.config_path.empty() ? "(defaults)" : opt.config_path, slices, slice_steps, cfg.model.d_model,
      cfg.model.n_layers, cfg.data.max_seq_len, cfg.train.cost_model);
  md += fmt::format(
      "Measured steps: all but the first step of each slice (process start, lazy allocations: {} warm-up step(s) per "
      "planner). tokens/s = sum of tokens / sum of step_time_s; predicted and measured step seconds are means over "
      "the measured steps that have a prediction; prediction error = median |predicted/measured - 1| over the same "
      "steps. Peak memory: the trainer's `peak_bytes`/`rank_peak_bytes` (n/a where the trainer does not write "
      "them). Rows are sorted by measured tokens/s, fastest first.\n\n",
      warmup.size());
  md += bench_markdown_table(rows);
  std::vector<std::string> order;
  for (const auto& r : rows) order.push_back(r.planner);
  md += fmt::format("\nMeasured ordering (tokens/s, fastest first): {}.\n", fmt::join(order, " > "));
  std::vector<BenchRow> by_model = rows;
  if (std::all_of(by_model.begin(), by_model.end(), [](const BenchRow& r) { return r.model_tokens_per_s; })) {
    std::stable_sort(by_model.begin(), by_model.end(), [](const BenchRow& a, const BenchRow& b) {
      return *a.model_tokens_per_s > *b.model_tokens_per_s;
    });
    std::vector<std::string> predicted;
    for (const auto& r : by_model) predicted.push_back(r.planner);
    md += fmt::format("Ordering the cost model predicts (uncalibrated `model_step_s`): {} ({}).\n",
                      fmt::join(predicted, " > "), predicted == order ? "the same" : "differs from the measured");
  }
  const std::vector<BenchRepetition> reps = summarize_repetitions(runs, warmup, slice_steps);
  md += fmt::format("\nPer repetition (slice; its warm-up step excluded):\n\n{}", bench_repetition_table(reps));
  int64_t opt_fastest = 0;
  std::vector<double> opt_vs_static, opt_vs_one_round;
  for (const auto& rep : reps) {
    opt_fastest += rep.fastest == "dcp-opt";
    if (rep.dcp_opt_over_best_static) opt_vs_static.push_back(*rep.dcp_opt_over_best_static);
    if (rep.dcp_opt_over_one_round) opt_vs_one_round.push_back(*rep.dcp_opt_over_one_round);
  }
  if (!opt_vs_static.empty()) {
    const auto [lo, hi] = std::minmax_element(opt_vs_static.begin(), opt_vs_static.end());
    md += fmt::format("\ndcp-opt was the fastest planner in {} of {} repetitions; its tokens/s over the best static "
                      "planner's (static, bucket, packed) ranged {:.3f}..{:.3f} over the repetitions.\n",
                      opt_fastest, reps.size(), *lo, *hi);
  }
  if (!opt_vs_one_round.empty()) {
    const auto [lo, hi] = std::minmax_element(opt_vs_one_round.begin(), opt_vs_one_round.end());
    md += fmt::format("dcp-opt's tokens/s over dcp-opt@1's (one partition per step, train.max_rounds 1) ranged "
                      "{:.3f}..{:.3f} over the repetitions.\n",
                      *lo, *hi);
  }
  const auto sp_errors = model_error_by_sp_sizes(runs, warmup);
  if (!sp_errors.empty()) {
    md += "\nUncalibrated cost-model error by the SP sizes of a step's groups (every planner's measured steps):\n\n"
          "| SP sizes in the step | steps | median \\|model_step_s / step_time_s - 1\\| |\n|---|---|---|\n";
    for (const auto& e : sp_errors) {
      md += fmt::format("| {} | {} | {:.1f}% |\n", e.sp_sizes, e.steps, 100.0 * e.median_error);
    }
  }
  if (auto err = overall_median_prediction_error(runs, warmup)) {
    md += fmt::format("Median step-time prediction error over every planner's measured steps: {:.1f}%.\n",
                      100.0 * *err);
  }
  std::vector<double> bpb;
  for (const auto& r : rows) {
    if (r.heldout_bits_per_byte_final) bpb.push_back(*r.heldout_bits_per_byte_final);
  }
  if (!bpb.empty()) {
    auto [lo, hi] = std::minmax_element(bpb.begin(), bpb.end());
    md += fmt::format("Held-out bits per byte after the same samples: {:.4f} .. {:.4f} (spread {:.2g}).\n", *lo, *hi,
                      *hi - *lo);
  }
  if (!png_name.empty()) md += fmt::format("\n![tokens/s and step times]({})\n", png_name);
  md += fmt::format("\nRuns (metrics.jsonl, summary.json, logs/, one bench_slice<N>.log per slice): `{}/<planner>/`.\n",
                    opt.out_dir);
  return md;
}

}  // namespace

int run_planner_bench(const PlannerBench& opt, const Config& cfg, std::string* failure) {
  const std::vector<std::string>& planners = opt.planners;
  const std::vector<std::string>& overrides = opt.overrides;
  const int64_t max_steps = cfg.train.max_steps, slice_steps = opt.slice_steps, slices = opt.slices;
  const fs::path out_dir(opt.out_dir);
  const fs::path report(opt.report);
  fmt::print("dcp bench: {} on {} processes, {} steps each in {} slices of {} steps; runs in {}/\n",
             fmt::join(planners, ", "), opt.nproc, max_steps, slices, slice_steps, out_dir.string());
  std::fflush(stdout);
  const double load_start = load_average_1min();
  std::set<int64_t> warmup;
  for (int64_t r = 0; r < slices; ++r) {
    warmup.insert(r * slice_steps + 1);
    for (size_t i = 0; i < planners.size(); ++i) {
      const std::string& planner = planners[(static_cast<size_t>(r) + i) % planners.size()];
      const fs::path run_dir = out_dir / planner;
      fs::create_directories(run_dir);
      std::vector<std::string> args = {"/proc/self/exe", "launch", "--nproc", std::to_string(opt.nproc),
                                       "--grace", fmt::format("{}", opt.grace_s), "--", "train"};
      if (!opt.config_path.empty()) args.insert(args.end(), {"--config", opt.config_path});
      args.insert(args.end(), overrides.begin(), overrides.end());
      // NAME@R: planner NAME with at most R rounds per step.
      const size_t at = planner.find('@');
      args.insert(args.end(), {"--train.planner=" + planner.substr(0, at),
                               fmt::format("--train.stop_after_steps={}", slice_steps), "--run.dir=" + run_dir.string()});
      if (at != std::string::npos) args.push_back("--train.max_rounds=" + planner.substr(at + 1));
      if (r > 0) args.push_back("--resume");
      const fs::path log = run_dir / fmt::format("bench_slice{}.log", r + 1);
      const auto start = std::chrono::steady_clock::now();
      const int code = run_child(args, log);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (code != 0) {  // the slice's own exit code, so that a usage error (2) stays one
        if (failure != nullptr) {
          *failure = fmt::format("planner {}, slice {}: `dcp {}` failed with exit code {}; see {}", planner, r + 1,
                                 fmt::join(args.begin() + 1, args.end(), " "), code, log.string());
        }
        return code;
      }
      fmt::print("slice {}/{}: {:<14} steps {}-{} in {:.1f} s\n", r + 1, slices, planner, r * slice_steps + 1,
                 std::min(max_steps, (r + 1) * slice_steps), seconds);
      std::fflush(stdout);
    }
  }
  const double load_end = load_average_1min();

  std::vector<BenchRun> runs;
  for (const auto& p : planners) runs.push_back(read_bench_run(p, (out_dir / p).string()));
  const std::vector<BenchRow> rows = summarize_bench(runs, warmup);
  const fs::path csv = report.string() + ".csv", md = report.string() + ".md", png = report.string() + ".png";
  write_text(csv, bench_csv(rows));
  if (opt.plot) {
    run_gnuplot(bench_gnuplot_script(csv.string(), png.string()), out_dir / "bench.gnuplot", out_dir / "gnuplot.log");
  }
  const std::string text = bench_markdown(opt, cfg, runs, rows, warmup, slice_steps, slices, load_start, load_end,
                                          opt.plot ? png.filename().string() : "");
  write_text(md, text);
  fmt::print("\n{}\nwrote {}, {}{}\n", bench_markdown_table(rows), md.string(), csv.string(),
             opt.plot ? ", " + png.string() : "");
  return 0;
}

}  // namespace dcp
