#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <set>

#include "cli/commands.h"
#include "dcp/profile.h"
#include "dcp/trainer.h"

namespace dcp {

std::vector<int64_t> sp_sizes_for(const Config& cfg, int64_t world_size, const std::vector<StepPlan>& plans) {
  std::vector<int64_t> sizes = resolve_sp_sizes(cfg.parallel.sp_sizes, world_size);
  if (cfg.parallel.sp_size > 0 && world_size % cfg.parallel.sp_size != 0) {
    throw ConfigError(fmt::format("config key 'parallel.sp_size': bad value '{}' (allowed: 0 or a divisor of the "
                                  "world size {})",
                                  cfg.parallel.sp_size, world_size));
  }
  std::set<int64_t> all(sizes.begin(), sizes.end());
  if (cfg.parallel.sp_size > 0) all.insert(cfg.parallel.sp_size);  // 0: sized to a size of parallel.sp_sizes
  if (cfg.parallel.sp_mode == "ulysses-ring" && cfg.parallel.sp_size > 0) {  // its Ulysses subgroups
    all.insert(ulysses_ring_size(cfg.parallel.sp_size, cfg.parallel.ulysses_size, cfg.model.kv_heads()));
  }
  for (const auto& p : plans) {
    for (const auto& g : p.groups) {
      // A valid plan may hold such a block (planners and the simulator use them), but a run creates process
      // groups of sizes dividing the world only.
      if (g.sp_size < 1 || world_size % g.sp_size != 0) {
        throw std::invalid_argument(fmt::format(
            "step plan (epoch {}, index {}): {}the group at rank {} has sp_size {}, which does not divide the world "
            "size {} (a run creates process groups of sizes that divide it)",
            p.epoch, p.index, p.num_rounds() > 1 ? fmt::format("round {}: ", g.round) : "", g.first_rank, g.sp_size,
            world_size));
      }
      all.insert(g.sp_size);
      // The subgroups of ulysses-ring; a bad size is left to StepPlan::validate, which names it.
      if (g.ulysses_size > 0 && world_size % g.ulysses_size == 0) all.insert(g.ulysses_size);
    }
  }
  return {all.begin(), all.end()};
}

void add_train_command(CLI::App& app) {
  auto* sub = app.add_subcommand("train", "Train a model (defaults: small byte-level LM on the Python docs)");
  auto config_path = std::make_shared<std::string>();
  auto plan_file = std::make_shared<std::string>();
  auto options = std::make_shared<TrainOptions>();
  sub->add_option("--config", *config_path, "YAML config file (see configs/)")->check(CLI::ExistingFile);
  sub->add_option("--plan-file", *plan_file, "execute these StepPlans (JSON, docs/step_plan.md) instead of planning")
      ->check(CLI::ExistingFile);
  auto* resume = sub->add_flag("--resume", options->resume, "continue from run_dir/checkpoint");
  sub->add_flag("--allow-data-change", options->allow_data_change,
                "with --resume: continue although the corpus under data.path changed (files added, removed or "
                "resized since the checkpoint; the data order and held-out split then differ)")
      ->needs(resume);
  sub->allow_extras();
  sub->footer("Any config key can be overridden as --section.key=value, e.g. --train.max_steps=100.");
  sub->callback([sub, config_path, plan_file, options] {
    Config cfg = Config::load(*config_path, config_overrides(*sub));
    options->plans = plan_file->empty() ? std::vector<StepPlan>{} : load_plans(*plan_file);
    DistEnv env = DistEnv::from_environment();
    ProcessGroups groups(env, cfg.dist.timeout_s, sp_sizes_for(cfg, env.world_size, options->plans));
    TrainSetup setup = open_training(cfg, groups, options->resume);
    RunCostModels models = resolve_cost_models(cfg, setup.shape, setup.threads, setup.lengths.max, groups);
    Trainer(cfg, groups, std::move(setup), std::move(models), *options).train();
  });
}

}  // namespace dcp
