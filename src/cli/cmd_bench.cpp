// `dcp bench`: its options, checked before any child runs; the driver is tools/planner_bench.h.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <memory>
#include <set>
#include <thread>

#include "cli/commands.h"
#include "dcp/planners.h"
#include "tools/bench_common.h"
#include "tools/planner_bench.h"
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
const char* const kBenchOwnedKeys[] = {"train.planner", "train.stop_after_steps", "run.dir", "train.max_rounds"};

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
    // NAME@R: planner NAME with train.max_rounds R (e.g. dcp-opt@1, one partition per step).
    const size_t at = name.find('@');
    const std::string base = name.substr(0, at);
    if (at != std::string::npos) {
      const std::string rounds = name.substr(at + 1);
      if (rounds.empty() || rounds.size() > 7 || rounds.find_first_not_of("0123456789") != std::string::npos) {
        throw CLI::ValidationError(fmt::format("--planners: '{}': after '@' comes train.max_rounds, a whole number "
                                               "(e.g. dcp-opt@1)",
                                               name));
      }
    }
    if (name == "all") {
      for (const auto& n : planner_names()) add(n);
    } else if (std::find(known.begin(), known.end(), base) != known.end()) {
      add(name);
    } else {
      throw CLI::ValidationError(
          fmt::format("--planners: unknown planner '{}' (known: {}, or all)", name, fmt::join(known, ", ")));
    }
  }
  return out;
}

void run_bench(const BenchOptions& opt, const std::vector<std::string>& overrides) {
  const std::vector<std::string> planners = parse_planners(opt.planners);
  for (const auto& o : overrides) {
    for (const char* key : kBenchOwnedKeys) {
      if (o.rfind(fmt::format("--{}=", key), 0) == 0) {
        throw CLI::ValidationError(
            fmt::format("'{}': dcp bench sets {} itself (use --planners, e.g. dcp-opt@1, / --out)", o, key));
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
  PlannerBench bench;
  bench.config_path = opt.config_path;
  bench.nproc = opt.nproc;
  bench.planners = planners;
  bench.overrides = overrides;
  bench.out_dir = opt.out_dir;
  bench.report = report.string();
  bench.slices = slices;
  bench.slice_steps = slice_steps;
  bench.grace_s = opt.grace_s;
  bench.plot = opt.plot;
  std::string failure;
  if (const int code = run_planner_bench(bench, cfg, &failure); code != 0) {
    report_error(failure);  // the slice's own exit code, so that a usage error (2) stays one
    throw CLI::RuntimeError(code);
  }
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
                  fmt::format("comma-separated planners; all = {}; static (parallel.sp_size everywhere) is also known; "
                              "NAME@R runs planner NAME with train.max_rounds R (dcp-opt@1: one partition per step)",
                              fmt::join(planner_names(), ",")));
  sub->add_option("--out", opt->out_dir, "folder of the runs, one per planner (DIR/<planner>)");
  sub->add_option("--report", opt->report, "path prefix of the .md, .csv and .png results (default: OUT/bench)");
  sub->add_option("--slices", opt->slices, "time slices per planner; the planners take turns slice by slice")
      ->check(CLI::Range(1, 1000000));
  sub->add_option("--grace", opt->grace_s, "dcp launch --grace of every slice")->check(finite_number_validator("seconds", 0, true, 3600));
  sub->add_flag("!--no-plot", opt->plot, "skip the gnuplot PNG");
  sub->allow_extras();
  sub->footer("Config keys are overridden as --section.key=value for every run, e.g. --train.max_steps=30; "
              "train.planner, train.max_rounds, train.stop_after_steps and run.dir are set by the bench.");
  sub->callback([sub, opt] { run_bench(*opt, config_overrides(*sub)); });
}

}  // namespace dcp
