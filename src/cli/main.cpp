#include <fmt/format.h>

#include "cli/commands.h"
#include "dcp/config.h"

namespace dcp {

std::vector<std::string> config_overrides(const CLI::App& sub) {
  std::vector<std::string> out;
  for (const auto& a : sub.remaining()) {
    if (a.rfind("--", 0) != 0 || a.find('=') == std::string::npos || a.find('.') > a.find('=')) {
      throw CLI::ValidationError(fmt::format("unexpected argument '{}' (config overrides look like "
                                             "--section.key=value, e.g. --model.d_model=256)",
                                             a));
    }
    out.push_back(a);
  }
  return out;
}

}  // namespace dcp

int main(int argc, char** argv) {
  CLI::App app{"dcp: Data-Centric Parallel training, Flexformer attention and KV-cache compression"};
  app.require_subcommand(1);
  dcp::add_train_command(app);
  dcp::add_launch_command(app);
  dcp::add_generate_command(app);
  dcp::add_verify_plan_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    fmt::print(stderr, "dcp: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
