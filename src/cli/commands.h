// Subcommands of the `dcp` binary; each registers itself on the app.
#pragma once

#include <CLI/CLI.hpp>

#include <limits>

#include "dcp/config.h"
#include "dcp/plan.h"

namespace dcp {

void add_train_command(CLI::App& app);
void add_launch_command(CLI::App& app);
void add_generate_command(CLI::App& app);
void add_verify_plan_command(CLI::App& app);
void add_simulate_command(CLI::App& app);
void add_plan_command(CLI::App& app);
void add_profile_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_bench_attention_command(CLI::App& app);
void add_bench_sp_attention_command(CLI::App& app);
void add_distill_command(CLI::App& app);
void add_kv_eval_command(CLI::App& app);
void add_kv_calibrate_command(CLI::App& app);
void add_serve_command(CLI::App& app);
void add_bench_serve_command(CLI::App& app);

/// SP sizes to create groups for: parallel.sp_sizes, parallel.sp_size and every size `plans` use.
/// Throws ConfigError when parallel.sp_sizes or parallel.sp_size names one that does not divide world_size (a
/// plan's sizes are StepPlan::validate's to check).
std::vector<int64_t> sp_sizes_for(const Config& cfg, int64_t world_size, const std::vector<StepPlan>& plans);

/// The CLI11 check of every floating-point option: the text must be a decimal number (parse_decimal: no hex,
/// inf or nan), finite, > 0 (>= 0 with `zero_ok`; >= `min` when min > 0) and <= `max`. Its error reads "must be
/// a positive (non-negative) finite number[ of <unit>][ (at least <min>) | (at most <max>) | in [<min>, <max>]],
/// got '<text>'" after the option's name, where CLI11's own ranges print DBL_MAX and let NaN through.
CLI::Validator finite_number_validator(const std::string& unit, double min = 0, bool zero_ok = false,
                                       double max = std::numeric_limits<double>::infinity());

/// The CLI11 check of a path option: an empty text (`--out ""`) is refused ("must not be empty: leave the option
/// out for its default") instead of silently meaning the default.
CLI::Validator non_empty_path_validator();

/// Prints a fatal error: to the run's log (and, on rank 0, the terminal) once logging is set up, else to
/// stderr with the rank.
void report_error(const std::string& message);

/// The config `dcp serve` and `dcp bench-serve` run with: the checkpoint's, then the serve section of
/// `config_path` (if not empty), then `overrides` (--serve.* and --kv.* only: the other keys fix the checkpoint's
/// weights). Throws ConfigError for another key or a bad value, std::runtime_error for an unreadable checkpoint.
Config serve_config(const std::string& checkpoint, const std::string& config_path,
                    const std::vector<std::string>& overrides);

/// Arguments CLI11 left over on `sub`, which must all be --section.key=value config overrides.
/// Throws CLI::ValidationError for anything else.
std::vector<std::string> config_overrides(const CLI::App& sub);

}  // namespace dcp
