// `dcp bench`: train the same samples with several planners on real local processes, in alternating time slices
// (each slice a `dcp launch ... train --resume` child), then compare what they measured (cli/bench_report.h).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <memory>
#include <set>
#include <thread>

#include "tools/bench_common.h"
#include "tools/bench_report.h"
#include "cli/commands.h"
#include "dcp/planners.h"
#include "util/file_write.h"

namespace fs = std::filesystem;

namespace dcp {
namespace {

struct BenchOptions {
  std::string config_path;
  int nproc = 2;
  std::string planners = "all";
  std::string out_dir = "runs/bench";
  std::string report;  ///< prefix of the .md/.csv/.png files; default out_dir/bench
  int slices = 3;  ///< time slices per planner
  double grace_s = 10.0;
  bool plot = true;
};

// Keys the bench sets itself on every slice.
const char* const kBenchOwnedKeys[] = {"train.planner", "train.stop_after_steps", "run.dir"};

std::vector<std::string> known_planners() {
  auto names = planner_names();
  names.push_back("static");  // the trainer's plain data-parallel layout (parallel.sp_size), as a baseline
  return names;
}

std::vector<std::string> parse_planners(const std::string& list) {
  const auto known = known_planners();
  std::vector<std::string> out;
  auto add = [&](const std::string& name) {
    if (std::find(out.begin(), out.end(), name) != out.end()) {
      throw CLI::ValidationError(fmt::format("--planners: planner '{}' is listed twice in '{}'", name, list));
    }
    out.push_back(name);
  };
  // Split by hand: getline would drop a trailing empty entry ("static,") and hide the typo.
  for (size_t start = 0, comma = 0; comma != std::string::npos; start = comma + 1) {
    comma = list.find(',', start);
    const std::string name = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (name.empty()) {
      throw CLI::ValidationError(fmt::format("--planners '{}': an empty entry (allowed: planner names separated "
                                             "by single commas, e.g. static,dcp-opt, or all)",
                                             list));
    }
    if (name == "all") {
      for (const auto& n : planner_names()) add(n);
    } else if (std::find(known.begin(), known.end(), name) != known.end()) {
      add(name);
    } else {
      throw CLI::ValidationError(
          fmt::format("--planners: unknown planner '{}' (known: {}, or all)", name, fmt::join(known, ", ")));
    }
  }
  return out;
}

std::string bench_markdown(const BenchOptions& opt, const Config& cfg, const std::vector<BenchRun>& runs,
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
  std::vector<double> opt_vs_static;
  for (const auto& rep : reps) {
    opt_fastest += rep.fastest == "dcp-opt";
    if (rep.dcp_opt_over_best_static) opt_vs_static.push_back(*rep.dcp_opt_over_best_static);
  }
  if (!opt_vs_static.empty()) {
    const auto [lo, hi] = std::minmax_element(opt_vs_static.begin(), opt_vs_static.end());
    md += fmt::format("\ndcp-opt was the fastest planner in {} of {} repetitions; its tokens/s over the best static "
                      "planner's (static, bucket, packed) ranged {:.3f}..{:.3f} over the repetitions.\n",
                      opt_fastest, reps.size(), *lo, *hi);
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

void run_bench(const BenchOptions& opt, const std::vector<std::string>& overrides) {
  const std::vector<std::string> planners = parse_planners(opt.planners);
  for (const auto& o : overrides) {
    for (const char* key : kBenchOwnedKeys) {
      if (o.rfind(fmt::format("--{}=", key), 0) == 0) {
        throw CLI::ValidationError(fmt::format("'{}': dcp bench sets {} itself (use --planners / --out)", o, key));
      }
    }
  }
  std::vector<std::string> config_args;
  for (const auto& o : overrides) config_args.push_back(o.substr(2));
  const Config cfg = Config::load(opt.config_path, config_args);  // bad keys fail here, before any child runs
  if (opt.plot && !gnuplot_available()) {
    throw std::runtime_error("gnuplot not found in PATH; install it (scripts/install-deps.sh installs gnuplot-nox) "
                             "or pass --no-plot");
  }
  const int64_t max_steps = cfg.train.max_steps;
  // The first step of every slice is a warm-up and is not measured: each slice needs a second step.
  if (max_steps < 2 * opt.slices) {
    throw CLI::ValidationError(fmt::format("train.max_steps {} is too few for --slices {}: every slice's first step "
                                           "is a warm-up, so dcp bench needs train.max_steps >= 2 x slices = {}",
                                           max_steps, opt.slices, 2 * opt.slices));
  }
  const int64_t slice_steps = (max_steps + opt.slices - 1) / opt.slices;
  const int64_t slices = (max_steps + slice_steps - 1) / slice_steps;
  const fs::path out_dir(opt.out_dir);
  const fs::path report = opt.report.empty() ? out_dir / "bench" : fs::path(opt.report);
  if (const std::string problem = folder_write_problem(out_dir); !problem.empty()) {
    throw CLI::ValidationError(fmt::format("--out '{}': {} (it must be a folder this user can write)",
                                           opt.out_dir, problem));
  }
  if (report.has_parent_path()) {
    if (const std::string problem = folder_write_problem(report.parent_path()); !problem.empty()) {
      throw CLI::ValidationError(fmt::format("--report '{}': {}", report.string(), problem));
    }
  }

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
      args.insert(args.end(), {"--train.planner=" + planner, fmt::format("--train.stop_after_steps={}", slice_steps),
                               "--run.dir=" + run_dir.string()});
      if (r > 0) args.push_back("--resume");
      const fs::path log = run_dir / fmt::format("bench_slice{}.log", r + 1);
      const auto start = std::chrono::steady_clock::now();
      const int code = run_child(args, log);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (code != 0) {  // the slice's own exit code, so that a usage error (2) stays one
        report_error(fmt::format("planner {}, slice {}: `dcp {}` failed with exit code {}; see {}", planner, r + 1,
                                 fmt::join(args.begin() + 1, args.end(), " "), code, log.string()));
        throw CLI::RuntimeError(code);
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
}

}  // namespace

void add_bench_command(CLI::App& app) {
  auto* sub = app.add_subcommand("bench", "Train the same samples with several planners side by side and compare "
                                          "measured throughput, imbalance, predicted vs measured step time");
  auto opt = std::make_shared<BenchOptions>();
  sub->add_option("--config", opt->config_path, "YAML config file of the training run (see configs/)")
      ->check(CLI::ExistingFile);
  sub->add_option("--nproc", opt->nproc, "local processes (ranks) of every run")->check(CLI::Range(1, 1024));
  sub->add_option("--planners", opt->planners,
                  fmt::format("comma-separated planners; all = {}; static (parallel.sp_size everywhere) is also known",
                              fmt::join(planner_names(), ",")));
  sub->add_option("--out", opt->out_dir, "folder of the runs, one per planner (DIR/<planner>)");
  sub->add_option("--report", opt->report, "path prefix of the .md, .csv and .png results (default: OUT/bench)");
  sub->add_option("--slices", opt->slices, "time slices per planner; the planners take turns slice by slice")
      ->check(CLI::Range(1, 1000000));
  sub->add_option("--grace", opt->grace_s, "dcp launch --grace of every slice")->check(finite_number_validator("seconds", 0, true, 3600));
  sub->add_flag("!--no-plot", opt->plot, "skip the gnuplot PNG");
  sub->allow_extras();
  sub->footer("Config keys are overridden as --section.key=value for every run, e.g. --train.max_steps=30; "
              "train.planner, train.stop_after_steps and run.dir are set by the bench.");
  sub->callback([sub, opt] { run_bench(*opt, config_overrides(*sub)); });
}

}  // namespace dcp
