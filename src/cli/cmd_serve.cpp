// dcp serve: the HTTP server over a checkpoint (docs/serve.md). Parses the options, loads the model, hands both
// to dcp::Server and turns SIGTERM / SIGINT into its graceful shutdown.
#include <fmt/format.h>
#include <pthread.h>
#include <signal.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <thread>

#include "cli/commands.h"
#include "dcp/checkpoint.h"
#include "dcp/serve.h"
#include "util/file_write.h"

namespace dcp {

Config serve_config(const std::string& checkpoint, const std::string& config_path,
                    const std::vector<std::string>& overrides) {
  Config cfg = load_checkpoint_config(checkpoint);
  // An error target sizes one generation's cache from the checkpoint's calibration (dcp generate); the server's
  // caches are chosen per request (kv_policy, kv_budget, kv_options) and reserved by their budget, which an error
  // target does not fix. A checkpoint trained with one still serves (the value is for dcp generate); asked for on
  // the command line it is refused rather than ignored.
  if (cfg.kv.max_rel_bpb != 0) {
    spdlog::warn("the checkpoint's kv.max_rel_bpb {} (an error target, for dcp generate) is not used by the server: "
                 "requests choose their cache by kv_policy, kv_budget and kv_options",
                 cfg.kv.max_rel_bpb);
    cfg.kv.max_rel_bpb = 0;
  }
  if (!config_path.empty()) {
    const Config file = Config::load(config_path, {});
    cfg.serve = file.serve;
  }
  for (const std::string& o : overrides) {
    const std::string kv = o.substr(2);
    const size_t eq = kv.find('=');
    const std::string key = kv.substr(0, eq);
    if (key.rfind("serve.", 0) != 0 && key.rfind("kv.", 0) != 0) {
      throw ConfigError(fmt::format("{}: dcp serve takes serve.* and kv.* overrides only (the other keys are the "
                                    "checkpoint's: they fix its weights)", o));
    }
    cfg.set(key, kv.substr(eq + 1));
    if (key == "kv.max_rel_bpb" && cfg.kv.max_rel_bpb != 0) {
      throw ConfigError(fmt::format("{}: the server does not take error targets (a request chooses its cache by "
                                    "kv_policy, kv_budget and kv_options; docs/serve.md)",
                                    o));
    }
  }
  cfg.validate();
  return cfg;
}

void add_serve_command(CLI::App& app) {
  auto* sub = app.add_subcommand("serve", "Serve a checkpoint over HTTP: the OpenAI completions API, a web page, metrics");
  struct Options {
    std::string checkpoint, config, host, port_file;
    int64_t port = -1, threads = -1;
  };
  auto o = std::make_shared<Options>();
  sub->add_option("--checkpoint", o->checkpoint, "checkpoint folder (run_dir/checkpoint) of a softmax or flexformer model")->required();
  sub->add_option("--config", o->config, "YAML file whose serve section is used (configs/, docs/serve.md)")
      ->check(CLI::ExistingFile);
  sub->add_option("--host", o->host, "address to bind (default serve.host, 127.0.0.1; 0.0.0.0 = every interface)");
  sub->add_option("--port", o->port, "port (default serve.port, 8080; 0 = an ephemeral one)")->check(CLI::Range(0, 65535));
  sub->add_option("--threads", o->threads, "intra-op threads of the model (default serve.threads; 0 = every core)")
      ->check(CLI::Range(0, 1024));
  sub->add_option("--port-file", o->port_file, "write the bound port to this file once listening (for scripts)");
  sub->allow_extras();
  sub->footer("serve.* and kv.* keys can be overridden as --section.key=value, e.g. --serve.kv_memory_bytes=2e8.");
  sub->callback([sub, o] {
    // SIGTERM and SIGINT are taken by one thread (sigtimedwait), never by a handler. Blocked first, before the
    // model starts LibTorch's worker threads, so that every thread inherits the mask and none is killed by them.
    sigset_t signals;
    sigemptyset(&signals);
    sigaddset(&signals, SIGTERM);
    sigaddset(&signals, SIGINT);
    pthread_sigmask(SIG_BLOCK, &signals, nullptr);
    if (!o->port_file.empty()) {
      // Checked before anything starts: a port file that cannot be written must not follow a "listening" line.
      const std::filesystem::path folder = std::filesystem::path(o->port_file).parent_path();
      if (!folder.empty() && !std::filesystem::is_directory(folder)) {
        throw ConfigError(fmt::format("--port-file {}: the folder {} does not exist", o->port_file, folder.string()));
      }
    }
    Config cfg = serve_config(o->checkpoint, o->config, config_overrides(*sub));
    if (!o->host.empty()) cfg.serve.host = o->host;
    if (o->port >= 0) cfg.serve.port = o->port;
    if (o->threads >= 0) cfg.serve.threads = o->threads;
    Transformer model(cfg.model, cfg.attention, resolve_precision(cfg.train.precision).precision);
    load_checkpoint(o->checkpoint, model, nullptr);
    std::filesystem::path dir = std::filesystem::path(o->checkpoint).lexically_normal();
    if (dir.filename().empty()) dir = dir.parent_path();
    std::string id = dir.filename().string();
    if (id == "checkpoint" && !dir.parent_path().filename().empty()) id = dir.parent_path().filename().string();

    Server server(std::move(model), cfg, id);
    const int port = server.bind();
    // The port file first: "listening" is printed only once everything a script waits for is in place.
    if (!o->port_file.empty()) write_file_atomically(o->port_file, std::to_string(port) + "\n");
    fmt::print("dcp serve: listening on http://{}:{} (model {}, KV memory {:.0f} bytes, scheduler {})\n", cfg.serve.host,
               port, id, cfg.serve.kv_memory_bytes, cfg.serve.scheduler);
    std::fflush(stdout);
    std::atomic<bool> done{false};
    std::thread waiter([&] {
      const timespec tick{0, 200 * 1000 * 1000};
      while (!done) {
        const int sig = sigtimedwait(&signals, nullptr, &tick);
        if (sig == SIGTERM || sig == SIGINT) {
          fmt::print("dcp serve: {} received: shutting down (grace {} s)\n", sig == SIGTERM ? "SIGTERM" : "SIGINT",
                     cfg.serve.shutdown_grace_s);
          std::fflush(stdout);
          server.shutdown();
        }
      }
    });
    server.run();
    done = true;
    waiter.join();
    fmt::print("dcp serve: stopped\n");
  });
}

}  // namespace dcp
