#include <fmt/format.h>

#include "cli/commands.h"
#include "dist/launcher.h"

namespace dcp {

namespace {

// A whole number in [min, max]; "abc" is "not a number" (CLI11 would say only that it cannot convert it).
CLI::Validator whole_number(const std::string& what, int64_t min, int64_t max) {
  return CLI::Validator(
      [what, min, max](std::string& text) -> std::string {
        size_t used = 0;
        long long v = 0;
        try {
          v = std::stoll(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (text.empty() || used != text.size()) {
          return fmt::format("'{}' is not a number (allowed: {} in [{}, {}])", text, what, min, max);
        }
        if (v < min || v > max) return fmt::format("{} is out of range (allowed: {} in [{}, {}])", text, what, min, max);
        return "";
      },
      "INT");
}

}  // namespace

void add_launch_command(CLI::App& app) {
  auto* sub = app.add_subcommand(
      "launch",
      "Start this node's ranks of a dcp command: dcp launch --nproc 2 -- train ... (several nodes: one launch per "
      "node with --nnodes N --node-rank K --master-addr HOST --master-port P)");
  auto opt = std::make_shared<LaunchOptions>();
  sub->add_option("--nproc", opt->nproc, "number of ranks on this node")->check(whole_number("a whole number", 1, 1024));
  sub->add_option("--nnodes", opt->nnodes, "number of nodes, each running one dcp launch (default 1)")
      ->check(whole_number("a whole number", 1, 1 << 20));
  sub->add_option("--node-rank", opt->node_rank, "this node, 0 .. nnodes-1; its ranks are node-rank*nproc + 0..nproc-1")
      ->check(whole_number("a whole number", 0, 1 << 20));
  sub->add_option("--master-addr", opt->master_addr,
                  "host of node 0, where rank 0 serves the rendezvous (default 127.0.0.1; required with --nnodes > 1)");
  sub->add_option("--master-port", opt->master_port,
                  "port of the rendezvous (default: a free port; required with --nnodes > 1)")
      ->check(whole_number("a port number", 1, 65535));
  sub->add_option("--grace", opt->grace_s, "seconds survivors get after SIGTERM before SIGKILL")
      ->check(finite_number_validator("seconds", 0, true, 3600));
  sub->add_option("--max-restarts", opt->max_restarts,
                  "restart the whole job (every node) up to N times after a failure, from its last good checkpoint "
                  "(default 0: the first failure ends it)")
      ->check(whole_number("a whole number", 0, 1000000));
  sub->add_option("--restart-backoff-s", opt->restart_backoff_s, "seconds between a failure and its restart (default 1)")
      ->check(finite_number_validator("seconds", 0, true, 3600));
  sub->add_option("--join-timeout-s", opt->join_timeout_s,
                  "with --max-restarts: seconds the launchers wait for each other at each (re)start (default 600)")
      ->check(finite_number_validator("seconds", 0, false, 86400));
  sub->add_option("command", opt->command, "the dcp subcommand (or program path) and its arguments, after --")
      ->required();
  sub->callback([opt] {
    try {
      validate_launch_options(*opt);
    } catch (const std::invalid_argument& e) {
      throw CLI::ValidationError(e.what());  // a usage error: exit 2
    }
    int code = launch_local(*opt);
    if (code != 0) throw CLI::RuntimeError(code);
  });
}

}  // namespace dcp
