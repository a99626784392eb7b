#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>

#include "cli/blas_cores.h"
#include "cli/commands.h"
#include "cli/host_memory.h"
#include "dcp/config.h"
#include "util/error_message.h"
#include "util/number_text.h"

namespace dcp {

CLI::Validator non_empty_path_validator() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        return text.empty() ? "must not be empty: leave the option out for its default" : "";
      },
      "PATH");
}

CLI::Validator finite_number_validator(const std::string& unit, double min, bool zero_ok, double max) {
  return CLI::Validator(
      [unit, min, zero_ok, max](std::string& text) -> std::string {
        const std::optional<double> parsed = parse_decimal(text);
        const double v = parsed.value_or(0);
        const bool ok = parsed && std::isfinite(v) && (min > 0 ? v >= min : zero_ok ? v >= 0 : v > 0) && v <= max;
        if (ok) return "";
        std::string bounds;
        if (min > 0 && std::isfinite(max)) {
          bounds = fmt::format(" in [{:g}, {:g}]", min, max);
        } else if (min > 0) {
          bounds = fmt::format(" (at least {:g})", min);
        } else if (std::isfinite(max)) {
          bounds = fmt::format(" (at most {:g})", max);
        }
        return fmt::format("must be a {} finite number{}{}, got '{}'", zero_ok ? "non-negative" : "positive",
                           unit.empty() ? "" : " of " + unit, bounds, text);
      },
      "NUMBER");
}

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

void report_error(const std::string& message) {
  // Once a run has its logger, the error also lands in the rank's log file, not only on the terminal.
  if (spdlog::default_logger()->name() == "dcp") {
    spdlog::error("{}", message);
  } else {
    const char* rank = std::getenv("RANK");
    fmt::print(stderr, "dcp{}: error: {}\n", rank ? fmt::format(" [rank {}]", rank) : "", message);
  }
}

}  // namespace dcp

// Exit codes: 0 success, 1 a runtime error (bad data, failed peer, ...), 2 a usage error (bad flags or
// config), 3 verify-plan found gradients that differ.
int main(int argc, char** argv) {
  dcp::ensure_openblas_kernels(argv);
  dcp::ensure_passive_openmp_for_serving(argc, argv);
  dcp::keep_freed_memory();
  CLI::App app{"dcp: Data-Centric Parallel training of transformers on variable-length sequences"};
  app.require_subcommand(1);
  dcp::add_train_command(app);
  dcp::add_launch_command(app);
  dcp::add_generate_command(app);
  dcp::add_verify_plan_command(app);
  dcp::add_plan_command(app);
  dcp::add_simulate_command(app);
  dcp::add_profile_command(app);
  dcp::add_bench_command(app);
  dcp::add_bench_attention_command(app);
  dcp::add_bench_sp_attention_command(app);
  dcp::add_distill_command(app);
  dcp::add_kv_eval_command(app);
  dcp::add_kv_calibrate_command(app);
  dcp::add_serve_command(app);
  dcp::add_bench_serve_command(app);
  if (argc > 1 && argv[1][0] != '-') {
    std::vector<std::string> known;
    for (const auto* sub : app.get_subcommands({})) known.push_back(sub->get_name());
    if (std::find(known.begin(), known.end(), argv[1]) == known.end()) {
      fmt::print(stderr, "dcp: error: unknown subcommand '{}' (known: {})\n", argv[1], fmt::join(known, ", "));
      return 2;
    }
  }
  // Each failure also goes to the error file of a rank under `dcp launch` (DCP_ERROR_FILE): its kind tells the
  // launcher whether a restart could help.
  try {
    app.parse(argc, argv);
  } catch (const CLI::RuntimeError& e) {  // a subcommand's own non-zero exit code
    return e.get_exit_code();
  } catch (const CLI::ParseError& e) {
    int code = app.exit(e);
    if (code != 0) dcp::write_error_file("usage", 2, e.what());
    return code == 0 ? 0 : 2;
  } catch (const dcp::ConfigError& e) {
    dcp::report_error(e.what());
    dcp::write_error_file("usage", 2, e.what());
    return 2;
  } catch (const dcp::RunFailure& e) {
    dcp::report_error(dcp::error_message(e));
    dcp::write_error_file(e.kind, 1, dcp::error_message(e));
    return 1;
  } catch (const std::exception& e) {
    dcp::report_error(dcp::error_message(e));
    dcp::write_error_file("runtime", 1, dcp::error_message(e));
    return 1;
  }
  return 0;
}
