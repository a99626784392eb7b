// `dcp serve` as a user runs it, on a tiny random checkpoint it writes itself: the port it reports (port 0, an
// ephemeral one), a completion byte for byte equal to `dcp generate` with the same seed, policy and budget,
// SIGTERM with requests in flight (they finish, the process exits 0) and usage errors (exit 2).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "dcp/checkpoint.h"
#include "dcp/config.h"
#include "dcp/model.h"
#include "distributed/process.h"
#include "infer/serve/client.h"
#include "runtime/optimizer.h"

namespace fs = std::filesystem;
using dcp::test::Child;
using nlohmann::json;

namespace {

fs::path workdir() {
  static const fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / ("dcp_cli_serve_" + std::to_string(getpid()));
    fs::remove_all(d);
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

fs::path checkpoint(const std::string& backend = "softmax") {
  const fs::path ckpt = workdir() / ("run_" + backend) / "checkpoint";
  if (fs::exists(ckpt / "state.json")) return ckpt;
  dcp::Config cfg;
  cfg.model.d_model = 64;
  cfg.model.n_layers = 2;
  cfg.model.n_heads = 4;
  cfg.model.d_ff = 128;
  // "softmax-target": a softmax checkpoint whose config carries an error target (kv.max_rel_bpb, dcp generate's).
  cfg.attention.backend = backend == "softmax-target" ? "softmax" : backend;
  if (backend == "softmax-target") cfg.kv.max_rel_bpb = 0.01;
  cfg.train.precision = "fp32";
  cfg.data.max_seq_len = 512;
  cfg.kv.chunk_tokens = 32;
  torch::manual_seed(3);
  dcp::Transformer model(cfg.model, cfg.attention, dcp::Precision::kFp32);
  {
    torch::NoGradGuard no_grad;
    for (const auto& item : model->named_parameters()) {
      if (item.key().find("wqkv") != std::string::npos) item.value().narrow(0, 0, 2 * cfg.model.d_model).mul_(8.0);
    }
  }
  auto optimizer = dcp::make_optimizer(model, cfg.train);
  dcp::save_checkpoint(ckpt.string(), model, *optimizer, dcp::TrainState{}, cfg);
  return ckpt;
}

std::string read(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// `dcp serve` on port 0; returns the child and the port it wrote (0 if it did not within 30 s).
std::pair<Child, int> start(const std::string& name, const std::vector<std::string>& extra = {},
                            const std::string& backend = "softmax") {
  const fs::path port_file = workdir() / (name + ".port");
  fs::remove(port_file);
  std::vector<std::string> args{DCP_BINARY, "serve", "--checkpoint", checkpoint(backend).string(), "--port", "0",
                                "--threads", "1", "--port-file", port_file.string()};
  args.insert(args.end(), extra.begin(), extra.end());
  Child c = Child::spawn(args, {{"OMP_NUM_THREADS", "1"}}, (workdir() / (name + ".log")).string());
  for (int i = 0; i < 600 && !fs::exists(port_file); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const std::string text = read(port_file);
  return {std::move(c), text.empty() ? 0 : std::stoi(text)};
}

int exit_code(int status) { return status >= 0 && WIFEXITED(status) ? WEXITSTATUS(status) : -1; }

}  // namespace

TEST(CliServe, ReportsItsPortAndAnswersLikeDcpGenerate) {
  auto [server, port] = start("generate");
  ASSERT_GT(port, 0) << server.log();
  EXPECT_NE(server.log().find("listening on http://127.0.0.1:" + std::to_string(port)), std::string::npos) << server.log();
  for (const auto& [policy, budget] : std::vector<std::pair<std::string, std::string>>{{"full", "1"}, {"window", "0.5"}}) {
    json body = {{"prompt", "Tell me"}, {"max_tokens", 50}, {"temperature", 0.9}, {"seed", 42},
                 {"return_bytes", true}, {"kv_policy", policy}};
    if (policy != "full") body["kv_budget"] = std::stod(budget);
    const auto reply = dcp::serve::complete("127.0.0.1", port, body, 30);
    ASSERT_EQ(reply.status, 200) << reply.body;
    std::string served;
    for (const auto& b : reply.json["choices"][0]["bytes"]) served.push_back(static_cast<char>(b.get<int>()));
    Child gen = Child::spawn({DCP_BINARY, "generate", "--checkpoint", checkpoint().string(), "--prompt", "Tell me",
                              "--max-new-tokens", "50", "--temperature", "0.9", "--seed", "42", "--kv.policy", policy,
                              "--kv.budget", budget},
                             {{"OMP_NUM_THREADS", "1"}}, (workdir() / ("gen_" + policy + ".log")).string());
    ASSERT_EQ(exit_code(gen.wait(60)), 0) << gen.log();
    // dcp generate prints the prompt, the bytes, a newline.
    EXPECT_EQ(gen.log(), "Tell me" + served + "\n") << policy;
  }
  kill(server.pid, SIGTERM);
  EXPECT_EQ(exit_code(server.wait(30)), 0) << server.log();
}

TEST(CliServe, SigtermLetsInFlightRequestsFinishAndExitsZero) {
  auto [server, port] = start("sigterm", {"--serve.shutdown_grace_s=20"});
  ASSERT_GT(port, 0) << server.log();
  std::vector<dcp::serve::ClientReply> replies(3);
  std::vector<std::thread> clients;
  for (int i = 0; i < 3; ++i) {
    clients.emplace_back([&, i, p = port] {
      replies[i] = dcp::serve::complete("127.0.0.1", p,
                                        {{"prompt", "in flight " + std::to_string(i)}, {"max_tokens", 300},
                                         {"temperature", 0}, {"stream", i != 1}},
                                        30);
    });
  }
  // Wait until all three run, then SIGTERM.
  for (int i = 0; i < 400; ++i) {
    const auto [status, text] = dcp::serve::get("127.0.0.1", port, "/metrics", 2);
    if (status == 200 && dcp::serve::metric(text, "dcp_sessions_active") == 3) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill(server.pid, SIGTERM);
  const int status = server.wait(40);
  for (auto& t : clients) t.join();
  EXPECT_EQ(exit_code(status), 0) << server.log();
  for (int i = 0; i < 3; ++i) {
    ASSERT_EQ(replies[i].status, 200) << i << ": " << replies[i].body << replies[i].error;
    const json& last = i != 1 ? replies[i].last : replies[i].json;
    EXPECT_EQ(last["choices"][0]["finish_reason"], "length") << i;
    if (i != 1) EXPECT_TRUE(replies[i].done);
  }
  const std::string log = server.log();
  EXPECT_NE(log.find("SIGTERM received"), std::string::npos) << log;
  EXPECT_NE(log.find("dcp serve: stopped"), std::string::npos) << log;
}

TEST(CliServe, UsageErrorsExitTwoNamingTheValue) {
  struct Case {
    std::vector<std::string> args;
    std::string expected;
  };
  const std::vector<Case> cases{
      {{"--model.d_model=32"}, "serve.* and kv.* overrides only"},
      {{"--serve.kv_policy=nope"}, "nope"},
      {{"--serve.scheduler=fast"}, "serve.scheduler"},
      {{"--serve.http_priority=high"}, "serve.http_priority"},
      // The rule's own message (an unregistered key would be refused as unknown, naming it too).
      {{"--serve.prefill_step_ratio=-1"}, "config key 'serve.prefill_step_ratio': bad value '-1'"},
      {{"--serve.prefill_step_ms=nan"}, "config key 'serve.prefill_step_ms': bad value 'nan'"},
      {{"--serve.port=70000"}, "serve.port"},
      {{"--kv.max_rel_bpb=0.01"}, "--kv.max_rel_bpb=0.01: the server does not take error targets"},
      // Refused before the server starts, so no "listening" line promises a port file that will not come.
      {{"--port-file", (workdir() / "no_such_folder" / "port").string()}, "no_such_folder does not exist"},
  };
  for (const Case& c : cases) {
    std::vector<std::string> args{DCP_BINARY, "serve", "--checkpoint", checkpoint().string(), "--port", "0"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    Child child = Child::spawn(args, {}, (workdir() / "usage.log").string());
    const int status = child.wait(60);
    EXPECT_EQ(exit_code(status), 2) << c.args[0] << ": " << child.log();
    EXPECT_NE(child.log().find(c.expected), std::string::npos) << child.log();
    EXPECT_EQ(child.log().find("listening"), std::string::npos) << child.log();
  }
  // A flexformer checkpoint has no KV cache to compress: a default policy other than full is a usage error.
  Child flex = Child::spawn({DCP_BINARY, "serve", "--checkpoint", checkpoint("flexformer").string(),
                             "--serve.kv_policy=window", "--serve.kv_budget=0.5"},
                            {}, (workdir() / "flex.log").string());
  EXPECT_EQ(exit_code(flex.wait(60)), 2) << flex.log();
  EXPECT_NE(flex.log().find("serve.kv_policy window"), std::string::npos) << flex.log();
  EXPECT_EQ(flex.log().find("listening"), std::string::npos) << flex.log();
  // The checkpoint's own kv.policy is named as such; a KV memory below one session's states admits nothing.
  for (const auto& [arg, expected] : std::vector<std::pair<std::string, std::string>>{
           {"--kv.policy=minimax", "kv.policy minimax"}, {"--serve.kv_memory_bytes=10000", "serve.kv_memory_bytes"}}) {
    Child c = Child::spawn({DCP_BINARY, "serve", "--checkpoint", checkpoint("flexformer").string(), "--port", "0", arg},
                           {}, (workdir() / "flex_arg.log").string());
    EXPECT_EQ(exit_code(c.wait(60)), 2) << arg << ": " << c.log();
    EXPECT_NE(c.log().find(expected), std::string::npos) << arg << ": " << c.log();
    EXPECT_EQ(c.log().find("listening"), std::string::npos) << c.log();
  }
  // A checkpoint whose config carries an error target still serves (the target is dcp generate's): the log says
  // it is not used; an explicit --kv.max_rel_bpb=0 is no error either.
  {
    auto [target, target_port] = start("target", {"--kv.max_rel_bpb=0"}, "softmax-target");
    ASSERT_GT(target_port, 0) << target.log();
    EXPECT_NE(target.log().find("the checkpoint's kv.max_rel_bpb 0.01 (an error target, for dcp generate) is not used"),
              std::string::npos)
        << target.log();
    kill(target.pid, SIGTERM);
    EXPECT_EQ(exit_code(target.wait(30)), 0) << target.log();
  }
  Child missing = Child::spawn({DCP_BINARY, "serve", "--checkpoint", (workdir() / "none").string()}, {},
                               (workdir() / "missing.log").string());
  EXPECT_EQ(exit_code(missing.wait(60)), 1) << missing.log();
}

// The page in a real browser: headless Debian chromium driven by playwright-core (tests/browser, installed by
// scripts/install-deps.sh). Skipped, with chromium's own reason, only where chromium cannot start.
TEST(CliServe, ThePageStreamsInHeadlessChromium) {
  const fs::path script = fs::path(DCP_SOURCE_DIR) / "tests" / "browser" / "check_page.mjs";
  ASSERT_TRUE(fs::exists(fs::path(DCP_SOURCE_DIR) / "tests" / "browser" / "node_modules" / "playwright-core"))
      << "playwright-core is not installed in tests/browser: run scripts/install-deps.sh";
  auto [server, port] = start("page");
  ASSERT_GT(port, 0) << server.log();
  const std::string shot = (fs::path(DCP_BUILD_DIR) / "serve_page.png").string();
  Child node = Child::spawn({"/usr/bin/env", "node", script.string(), "http://127.0.0.1:" + std::to_string(port) + "/", shot},
                            {}, (workdir() / "page.log").string());
  const int status = node.wait(120);
  const std::string log = node.log();
  kill(server.pid, SIGTERM);
  EXPECT_EQ(exit_code(server.wait(30)), 0) << server.log();
  if (exit_code(status) == 77) GTEST_SKIP() << log;
  EXPECT_EQ(exit_code(status), 0) << log;
  EXPECT_NE(log.find("page ok"), std::string::npos) << log;
  EXPECT_TRUE(fs::exists(shot));
}

// A flexformer checkpoint is served from recurrent states: a completion equals `dcp generate`'s bytes with the same
// seed, the reply's kv_cache counts the states' bytes, a cache policy is a 400, and SIGTERM exits 0.
TEST(CliServe, ServesAFlexformerCheckpointLikeDcpGenerate) {
  auto [server, port] = start("flex_generate", {}, "flexformer");
  ASSERT_GT(port, 0) << server.log();
  const auto reply = dcp::serve::complete("127.0.0.1", port,
                                          {{"prompt", "Tell me"}, {"max_tokens", 50}, {"temperature", 0.9},
                                           {"seed", 42}, {"return_bytes", true}},
                                          30);
  ASSERT_EQ(reply.status, 200) << reply.body;
  std::string served;
  for (const auto& b : reply.json["choices"][0]["bytes"]) served.push_back(static_cast<char>(b.get<int>()));
  EXPECT_EQ(reply.json["kv_cache"]["policy"], "full");
  EXPECT_GT(reply.json["kv_cache"]["bytes"].get<int64_t>(), 0);
  EXPECT_EQ(reply.json["kv_cache"]["bytes"], reply.json["kv_cache"]["reserved_bytes"]);
  Child gen = Child::spawn({DCP_BINARY, "generate", "--checkpoint", checkpoint("flexformer").string(), "--prompt",
                            "Tell me", "--max-new-tokens", "50", "--temperature", "0.9", "--seed", "42"},
                           {{"OMP_NUM_THREADS", "1"}}, (workdir() / "gen_flex.log").string());
  ASSERT_EQ(exit_code(gen.wait(60)), 0) << gen.log();
  EXPECT_EQ(gen.log(), "Tell me" + served + "\n");
  const auto refused = dcp::serve::complete("127.0.0.1", port,
                                            {{"prompt", "x"}, {"kv_policy", "minimax"}, {"kv_budget", 0.25}}, 30);
  EXPECT_EQ(refused.status, 400) << refused.body;
  EXPECT_EQ(refused.json["error"]["param"], "kv_policy") << refused.body;
  kill(server.pid, SIGTERM);
  EXPECT_EQ(exit_code(server.wait(30)), 0) << server.log();
}
