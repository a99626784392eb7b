// dcp bench-serve: a bounded loopback load on dcp serve (src/tools/serve_bench.cpp does the work).
#include <fmt/format.h>

#include "cli/commands.h"
#include "dcp/checkpoint.h"
#include "dcp/infer.h"
#include "tools/serve_bench.h"

namespace dcp {

// Each client is a thread of this process and its connection one of the server's handler threads: 1024 clients
// ran in 15 s on 2 cores (a short load), 4096 (8,200 threads) did not finish in 300 s.
constexpr int64_t kMostClients = 1024;

void add_bench_serve_command(CLI::App& app) {
  auto* sub = app.add_subcommand("bench-serve", "Load dcp serve on loopback: throughput, latency, sessions per KV memory");
  auto o = std::make_shared<ServeBenchOptions>();
  auto checkpoint = std::make_shared<std::string>();
  sub->add_option("--checkpoint", *checkpoint, "checkpoint folder of a softmax or flexformer model")->required();
  sub->add_option("--out", o->out, "result files PREFIX.md, .csv, .png (e.g. bench/results/cpu2_serve)")->required();
  sub->add_option("--clients", o->clients, "concurrency levels of the throughput runs")->delimiter(',');
  sub->add_option("--requests", o->requests, "requests per throughput run (at least the clients)")->check(CLI::Range(1, 100000));
  sub->add_option("--min-prompt", o->min_prompt, "shortest prompt, bytes")->check(CLI::Range(1, 1 << 24));
  sub->add_option("--max-prompt", o->max_prompt, "longest prompt, bytes")->check(CLI::Range(1, 1 << 24));
  sub->add_option("--max-tokens", o->max_tokens, "completion bytes per request")->check(CLI::Range(1, 1 << 20));
  sub->add_option("--batching-sessions", o->batching_sessions,
                  "batching runs: sessions sent at once, then one after another; 0 = no batching runs")
      ->check(CLI::Range(int64_t{0}, kMostClients));
  sub->add_option("--batching-tokens", o->batching_tokens,
                  "completion bytes per request of the batching runs (>= 2; short ones may leave no interval in which "
                  "every session decodes, and no rate)")
      ->check(CLI::Range(2, 1 << 20));
  sub->add_option("--batching-repeats", o->batching_repeats,
                  "pairs of batching runs, alternating which runs first (an even number balances a drift); the "
                  "ratio is pooled over them (default 4)")
      ->check(CLI::Range(1, 100));
  auto* policies = sub->add_option("--policies", o->policies,
                                   "memory runs: NAME or NAME@BUDGET (default: full and window, minimax at 0.25 and 0.5; "
                                   "full alone for a flexformer checkpoint)")
                       ->delimiter(',');
  sub->add_option("--memory-clients", o->memory_clients, "clients of the memory runs")->check(CLI::Range(int64_t{1}, kMostClients));
  sub->add_option("--memory-requests", o->memory_requests, "requests per memory run; 0 = no memory runs")
      ->check(CLI::Range(0, 100000));
  sub->add_option("--memory-bytes", o->memory_bytes, "serve.kv_memory_bytes of the memory runs (0: memory-full-sessions full caches of the mean prompt)")
      ->check(finite_number_validator("bytes", 0, true));
  sub->add_option("--memory-full-sessions", o->memory_full_sessions, "full caches the default memory holds")->check(CLI::Range(1, 4096));
  sub->add_option("--seed", o->seed, "prompt choice");
  sub->add_option("--client-priority", o->client_priority,
                  "idle: the client threads run under SCHED_IDLE, on time the server leaves (a load generator on "
                  "another machine); normal: at the server's priority (default normal)")
      ->check(CLI::IsMember({"idle", "normal"}));
  sub->add_flag("!--no-plot", o->plot, "skip the PNG");
  sub->allow_extras();
  sub->footer("serve.* and kv.* keys can be overridden as --section.key=value (e.g. --serve.chunk_tokens=64).");
  sub->callback([sub, o, checkpoint, policies] {
    if (o->min_prompt > o->max_prompt) {
      throw ConfigError(fmt::format("--min-prompt {} is above --max-prompt {}", o->min_prompt, o->max_prompt));
    }
    for (int64_t c : o->clients) {
      if (c < 1 || c > kMostClients) {
        throw ConfigError(fmt::format("--clients: {} must be in [1, {}] (each client is a thread, and so is its "
                                      "connection's handler)", c, kMostClients));
      }
    }
    Config cfg = serve_config(*checkpoint, "", config_overrides(*sub));
    Transformer model(cfg.model, cfg.attention, resolve_precision(cfg.train.precision).precision);
    load_checkpoint(*checkpoint, model, nullptr);
    // A flexformer checkpoint has nothing to compress: its memory runs default to policy full alone.
    if (policies->count() == 0 && decodes_recurrently(model)) o->policies = {"full"};
    run_serve_bench(model, cfg, *checkpoint, *o);
  });
}

}  // namespace dcp
