#include <spdlog/spdlog.h>

#include "cli/commands.h"
#include "dcp/train.h"

namespace dcp {

void add_train_command(CLI::App& app) {
  auto* sub = app.add_subcommand("train", "Train a model (defaults: small byte-level LM on the Python docs)");
  auto config_path = std::make_shared<std::string>();
  auto resume = std::make_shared<bool>(false);
  sub->add_option("--config", *config_path, "YAML config file (see configs/)")->check(CLI::ExistingFile);
  sub->add_flag("--resume", *resume, "continue from run_dir/checkpoint");
  sub->allow_extras();
  sub->footer("Any config key can be overridden as --section.key=value, e.g. --train.max_steps=100.");
  sub->callback([sub, config_path, resume] {
    Config cfg = Config::load(*config_path, config_overrides(*sub));
    DistEnv env = DistEnv::from_environment();
    ProcessGroups groups(env, cfg.dist.timeout_s);
    int code = train(cfg, groups, *resume);
    if (code != 0) throw CLI::RuntimeError(code);
  });
}

}  // namespace dcp
