#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include "cli/commands.h"
#include "dcp/step_runner.h"
#include "dist/launcher.h"

namespace dcp {
namespace {

struct VerifyArgs {
  std::string plan_file, config_path;
  int nproc = 2;
  int64_t step = 0;
  double tolerance = 1e-4;
};

// The --step'th plan of the plan file; a step the file does not hold is a usage error.
StepPlan plan_of_step(const VerifyArgs& a) {
  std::vector<StepPlan> plans = load_plans(a.plan_file);
  if (a.step < 0 || a.step >= static_cast<int64_t>(plans.size())) {
    throw ConfigError(fmt::format("--step {}: plan file '{}' holds {} step(s), numbered from 0", a.step, a.plan_file,
                                  plans.size()));
  }
  return plans[static_cast<size_t>(a.step)];
}

// "none" for sp 1, else the mode ("ulysses-ring U" with its ulysses_size).
std::string mode_of(const GroupPlan& g) {
  std::string m = g.sp_size == 1 ? "none" : sp_mode_name(g.sp_mode);
  if (g.sp_mode == SpMode::kUlyssesRing) m += fmt::format(" {}", g.ulysses_size);
  return m;
}

// Runs as every rank: one distributed step, then the single-process reference on the same samples.
void verify_as_rank(const VerifyArgs& a, const std::vector<std::string>& overrides) {
  Config cfg = Config::load(a.config_path, overrides);
  const StepPlan plan = plan_of_step(a);
  DistEnv env = DistEnv::from_environment();
  Corpus corpus = Corpus::load(cfg.data);
  plan.validate(env.world_size, corpus.samples(), cfg.model.n_layers);
  ProcessGroups groups(env, cfg.dist.timeout_s, sp_sizes_for(cfg, env.world_size, {plan}));

  torch::set_num_threads(1);
  // fp32 whatever train.precision: the check is that a plan computes the same gradient as one process, and bf16
  // rounding differs with the shapes a plan gives its matmuls.
  torch::manual_seed(static_cast<uint64_t>(cfg.run.seed));
  Transformer model(cfg.model, cfg.attention, Precision::kFp32);
  StepStats r = compute_step_gradients(model, corpus, plan, groups);
  if (env.rank != 0) return;
  torch::manual_seed(static_cast<uint64_t>(cfg.run.seed));
  Transformer reference(cfg.model, cfg.attention, Precision::kFp32);
  double ref_loss = reference_step_gradients(reference, corpus, plan);
  GradientComparison c = compare_gradients(model, reference);
  bool pass = c.max_rel_err <= a.tolerance;
  nlohmann::json out = {{"plan_file", a.plan_file},
                        {"step", a.step},
                        {"world_size", env.world_size},
                        {"rounds", plan.num_rounds()},
                        {"sp_sizes", [&] {
                           std::vector<int64_t> s;
                           for (const auto& g : plan.groups) s.push_back(g.sp_size);
                           return s;
                         }()},
                        {"sp_modes", [&] {
                           std::vector<std::string> s;
                           for (const auto& g : plan.groups) s.push_back(mode_of(g));
                           return s;
                         }()},
                        {"round_sp_sizes", [&] {
                           std::vector<std::vector<int64_t>> s(static_cast<size_t>(plan.num_rounds()));
                           for (const auto& g : plan.groups) s[static_cast<size_t>(g.round)].push_back(g.sp_size);
                           return s;
                         }()},
                        {"round_sp_modes", [&] {
                           std::vector<std::vector<std::string>> s(static_cast<size_t>(plan.num_rounds()));
                           for (const auto& g : plan.groups) s[static_cast<size_t>(g.round)].push_back(mode_of(g));
                           return s;
                         }()},
                        {"rank_round_s", r.rank_round_s},
                        {"global_num_tokens", plan.global_num_tokens},
                        {"precision", precision_name(Precision::kFp32)},
                        {"loss_parallel", r.loss},
                        {"loss_reference", ref_loss},
                        {"max_abs_err", c.max_abs_err},
                        {"max_abs_grad", c.max_abs_ref},
                        {"max_rel_err", c.max_rel_err},
                        {"tolerance", a.tolerance},
                        {"pass", pass}};
  fmt::print("{}\n", out.dump(2));
  if (!pass) throw CLI::RuntimeError(3);
}

}  // namespace

void add_verify_plan_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "verify-plan", "Run one step of a plan on N local ranks and compare its gradients with a single process");
  auto a = std::make_shared<VerifyArgs>();
  sub->add_option("--plan-file", a->plan_file, "StepPlan JSON (docs/step_plan.md)")->required()->check(CLI::ExistingFile);
  sub->add_option("--nproc", a->nproc, "ranks to start (the plan's world_size)")->check(CLI::Range(1, 1024));
  sub->add_option("--config", a->config_path, "YAML config (model shape, corpus)")->check(CLI::ExistingFile);
  sub->add_option("--step", a->step, "which step of the plan file (0-based)");
  sub->add_option("--tolerance", a->tolerance, "pass when max_rel_err <= this")->check(finite_number_validator("", 1e-12, false, 1.0));
  sub->allow_extras();
  sub->footer("Prints JSON with the plan's rounds (round_sp_sizes, round_sp_modes: each round's groups; "
              "rank_round_s: each rank's seconds per round), max_abs_err, max_rel_err (= max_abs_err / max "
              "|reference gradient|) and pass; exits 3 when the check fails. Both sides compute in fp32 whatever "
              "train.precision.");
  sub->callback([sub, a] {
    // Results go to stdout as JSON; keep log lines on stderr.
    spdlog::set_default_logger(spdlog::stderr_color_mt("verify-plan"));
    std::vector<std::string> overrides = config_overrides(*sub);
    if (std::getenv("RANK") != nullptr) {
      verify_as_rank(*a, overrides);
      return;
    }
    plan_of_step(*a);  // before any rank starts
    LaunchOptions launch;
    launch.nproc = a->nproc;
    launch.command = {"verify-plan", "--plan-file", a->plan_file, "--step", std::to_string(a->step), "--tolerance",
                      fmt::format("{}", a->tolerance)};
    if (!a->config_path.empty()) launch.command.insert(launch.command.end(), {"--config", a->config_path});
    launch.command.insert(launch.command.end(), overrides.begin(), overrides.end());
    int code = launch_local(launch);
    if (code != 0) throw CLI::RuntimeError(code);
  });
}

}  // namespace dcp
