#include "cli/commands.h"
#include "cli/launcher.h"

namespace dcp {

void add_launch_command(CLI::App& app) {
  auto* sub = app.add_subcommand("launch", "Start N local ranks of a dcp command: dcp launch --nproc 2 -- train ...");
  auto opt = std::make_shared<LaunchOptions>();
  sub->add_option("--nproc", opt->nproc, "number of local processes (ranks)")->check(CLI::Range(1, 1024));
  sub->add_option("--grace", opt->grace_s, "seconds survivors get after SIGTERM before SIGKILL")
      ->check(finite_number_validator("seconds", 0, true, 3600));
  sub->add_option("command", opt->command, "the dcp subcommand (or program path) and its arguments, after --")
      ->required();
  sub->callback([opt] {
    int code = launch_local(*opt);
    if (code != 0) throw CLI::RuntimeError(code);
  });
}

}  // namespace dcp
