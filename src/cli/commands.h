// Subcommands of the `dcp` binary; each registers itself on the app.
#pragma once

#include <CLI/CLI.hpp>

namespace dcp {

void add_train_command(CLI::App& app);
void add_launch_command(CLI::App& app);
void add_generate_command(CLI::App& app);

/// Arguments CLI11 left over on `sub`, which must all be --section.key=value config overrides.
/// Throws CLI::ValidationError for anything else.
std::vector<std::string> config_overrides(const CLI::App& sub);

}  // namespace dcp
