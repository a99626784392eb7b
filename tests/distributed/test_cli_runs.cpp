// End-to-end runs of the dcp binary: launcher, resume, and what happens when a rank dies or hangs.
#include <gtest/gtest.h>

#include <fcntl.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "distributed/process.h"

namespace fs = std::filesystem;
using dcp::test::Child;
using dcp::test::exited_ok;

namespace {

// A JSONL corpus of a few hundred short documents in a fresh folder.
fs::path make_workdir(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / ("dcp_cli_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream out(dir / "corpus.jsonl");
  for (int i = 0; i < 300; ++i) {
    std::string text = "Document " + std::to_string(i) + ": the quick brown fox jumps over the lazy dog. ";
    for (int j = 0; j < i % 7; ++j) text += "Lorem ipsum dolor sit amet " + std::to_string(j) + ". ";
    out << nlohmann::json({{"text", text}}).dump() << "\n";
  }
  return dir;
}

std::vector<std::string> train_args(const fs::path& dir, const std::vector<std::string>& extra) {
  std::vector<std::string> a = {"train",
                                "--data.path=" + (dir / "corpus.jsonl").string(),
                                "--run.dir=" + (dir / "run").string(),
                                "--model.d_model=32",
                                "--model.n_layers=2",
                                "--model.n_heads=2",
                                "--model.d_ff=64",
                                "--data.max_seq_len=128",
                                "--train.micro_batch_tokens=512",
                                "--train.global_batch_tokens=1024",
                                "--train.threads=1",
                                "--eval.max_tokens=2048",
                                "--dist.timeout_s=8"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

std::vector<std::string> launch(int nproc, const std::vector<std::string>& cmd) {
  std::vector<std::string> a = {DCP_BINARY, "launch", "--nproc", std::to_string(nproc), "--grace", "3", "--"};
  a.insert(a.end(), cmd.begin(), cmd.end());
  return a;
}

std::vector<double> losses(const fs::path& metrics) {
  std::vector<double> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line).at("loss"));
  return out;
}

int count_lines(const fs::path& p) {
  std::ifstream in(p);
  int n = 0;
  for (std::string line; std::getline(in, line);) ++n;
  return n;
}

std::map<std::string, std::string> rank_env(int rank, int world, int port) {
  return {{"RANK", std::to_string(rank)},       {"WORLD_SIZE", std::to_string(world)},
          {"LOCAL_RANK", std::to_string(rank)}, {"LOCAL_WORLD_SIZE", std::to_string(world)},
          {"MASTER_ADDR", "127.0.0.1"},         {"MASTER_PORT", std::to_string(port)}};
}

int test_port() { return 20000 + static_cast<int>(getpid() % 20000); }

// Starts ranks 0 and 1 of a training run by hand (no launcher) and waits until two steps are logged.
std::pair<Child, Child> start_two_ranks(const fs::path& dir, const std::vector<std::string>& extra, int port) {
  auto args = train_args(dir, extra);
  args.insert(args.begin(), DCP_BINARY);
  Child r0 = Child::spawn(args, rank_env(0, 2, port), (dir / "r0.log").string());
  Child r1 = Child::spawn(args, rank_env(1, 2, port), (dir / "r1.log").string());
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (count_lines(dir / "run" / "metrics.jsonl") < 2 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return {std::move(r0), std::move(r1)};
}

}  // namespace

TEST(CliRuns, TrainWritesOutputsAndResumeReproducesLosses) {
  fs::path dir = make_workdir("resume");
  Child full = Child::spawn(launch(2, train_args(dir, {"--train.max_steps=6", "--run.dir=" + (dir / "full").string()})),
                            {}, (dir / "full.log").string());
  ASSERT_TRUE(exited_ok(full.wait(240))) << full.log();
  for (const char* f : {"config.yaml", "metrics.jsonl", "summary.json", "checkpoint/model.pt"}) {
    EXPECT_TRUE(fs::exists(dir / "full" / f)) << f;
  }
  auto summary = nlohmann::json::parse(std::ifstream(dir / "full" / "summary.json"));
  EXPECT_EQ(summary.at("world_size"), 2);
  EXPECT_GT(summary.at("tokens_trained").get<int64_t>(), 0);

  std::vector<std::string> part = {"--train.max_steps=6", "--train.stop_after_steps=3",
                                   "--run.dir=" + (dir / "part").string()};
  Child first = Child::spawn(launch(2, train_args(dir, part)), {}, (dir / "part1.log").string());
  ASSERT_TRUE(exited_ok(first.wait(240))) << first.log();
  EXPECT_EQ(count_lines(dir / "part" / "metrics.jsonl"), 3);
  part.push_back("--resume");
  Child second = Child::spawn(launch(2, train_args(dir, part)), {}, (dir / "part2.log").string());
  ASSERT_TRUE(exited_ok(second.wait(240))) << second.log();

  auto a = losses(dir / "full" / "metrics.jsonl"), b = losses(dir / "part" / "metrics.jsonl");
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), 6u);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-6 * std::abs(a[i])) << "step " << i + 1;
  fs::remove_all(dir);
}

TEST(CliRuns, PlannerChoiceDoesNotChangeTheLosses) {
  // Same samples per step (same order and token budget), different groups and SP sizes: the step gradient is
  // that of the same mean token loss, so the loss curve must agree up to float summation order.
  fs::path dir = make_workdir("planners");
  std::map<std::string, std::vector<double>> curves;
  for (const std::string planner : {"static", "dcp-opt", "packed"}) {
    Child c = Child::spawn(launch(2, train_args(dir, {"--train.max_steps=3", "--train.planner=" + planner,
                                                      "--run.dir=" + (dir / planner).string()})),
                           {}, (dir / (planner + ".log")).string());
    ASSERT_TRUE(exited_ok(c.wait(240))) << c.log();
    curves[planner] = losses(dir / planner / "metrics.jsonl");
    auto last = nlohmann::json::parse(std::ifstream(dir / planner / "summary.json"));
    EXPECT_EQ(last.at("planner"), planner);
  }
  for (const auto& [planner, curve] : curves) {
    ASSERT_EQ(curve.size(), 3u) << planner;
    for (size_t i = 0; i < curve.size(); ++i) {
      EXPECT_NEAR(curve[i], curves["static"][i], 1e-4 * curves["static"][i]) << planner << " step " << i + 1;
    }
  }
  fs::remove_all(dir);
}

TEST(CliRuns, ResumeWithoutHeldOutDataAndRefusesAChangedModel) {
  fs::path dir = make_workdir("resume_checks");
  auto run = [&](const std::vector<std::string>& extra, const std::string& log) {
    auto args = train_args(dir, {"--data.heldout_fraction=0", "--train.max_steps=2", "--train.stop_after_steps=1"});
    args.insert(args.begin(), DCP_BINARY);
    args.insert(args.end(), extra.begin(), extra.end());
    Child c = Child::spawn(args, {}, (dir / log).string());
    int status = c.wait(120);
    return std::make_pair(status, c.log());
  };
  auto [s1, log1] = run({}, "first.log");
  ASSERT_TRUE(exited_ok(s1)) << log1;
  EXPECT_NE(log1.find("no held-out samples"), std::string::npos) << log1;
  auto [s2, log2] = run({"--resume", "--model.d_model=64"}, "changed.log");
  EXPECT_FALSE(exited_ok(s2));
  EXPECT_NE(log2.find("'model.d_model' is '32' there but '64' now"), std::string::npos) << log2;
  auto [s3, log3] = run({"--resume"}, "resumed.log");
  ASSERT_TRUE(exited_ok(s3)) << log3;
  EXPECT_EQ(count_lines(dir / "run" / "metrics.jsonl"), 2);
  fs::remove_all(dir);
}

TEST(CliRuns, KilledRankStopsThePeerWithAnError) {
  fs::path dir = make_workdir("kill");
  auto [r0, r1] = start_two_ranks(dir, {"--train.max_steps=100000"}, test_port());
  ASSERT_GE(count_lines(dir / "run" / "metrics.jsonl"), 2) << r0.log();
  r1.kill_now();
  int status = r0.wait(30);
  ASSERT_NE(status, -1) << "rank 0 hung after its peer died:\n" << r0.log();
  EXPECT_FALSE(exited_ok(status));
  EXPECT_NE(r0.log().find("error"), std::string::npos) << r0.log();
  fs::remove_all(dir);
}

TEST(CliRuns, HungRankMakesThePeerFailWithinTheTimeout) {
  fs::path dir = make_workdir("hang");
  auto [r0, r1] = start_two_ranks(dir, {"--train.max_steps=100000", "--dist.timeout_s=4"}, test_port() + 1);
  ASSERT_GE(count_lines(dir / "run" / "metrics.jsonl"), 2) << r0.log();
  kill(r1.pid, SIGSTOP);
  int status = r0.wait(40);
  ASSERT_NE(status, -1) << "rank 0 hung past the timeout:\n" << r0.log();
  EXPECT_FALSE(exited_ok(status));
  EXPECT_NE(r0.log().find("timeout"), std::string::npos) << r0.log();
  r1.kill_now();
  fs::remove_all(dir);
}

TEST(CliRuns, LauncherStopsAllRanksWhenOneFails) {
  fs::path dir = make_workdir("launch");
  fs::path marker = dir / "survivor_finished";
  std::string script = "if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 30; touch " + marker.string();
  auto start = std::chrono::steady_clock::now();
  Child l = Child::spawn(launch(3, {"/bin/sh", "-c", script}), {}, (dir / "launch.log").string());
  int status = l.wait(25);
  double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_NE(status, -1) << l.log();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3) << l.log();
  EXPECT_LT(elapsed, 15.0);
  EXPECT_NE(l.log().find("rank 1"), std::string::npos) << l.log();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  EXPECT_FALSE(fs::exists(marker));
  fs::remove_all(dir);
}

TEST(CliRuns, BadInputsGiveClearErrors) {
  fs::path dir = make_workdir("bad");
  struct Case {
    std::vector<std::string> args;
    std::string expected;
  };
  std::vector<Case> cases = {
      {{"train", "--model.n_layers=-2"}, "model.n_layers"},
      {{"train", "--data.path=/nonexistent/corpus"}, "/nonexistent/corpus"},
      {{"train", "--no-such-flag"}, "--no-such-flag"},
      {{"generate", "--checkpoint", (dir / "missing").string(), "--prompt", "x"}, "missing"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> args = {DCP_BINARY};
    args.insert(args.end(), c.args.begin(), c.args.end());
    args.push_back("--run.dir=" + (dir / "run").string());
    if (c.args[0] == "generate") args.pop_back();
    Child ch = Child::spawn(args, {}, (dir / "bad.log").string());
    int status = ch.wait(60);
    EXPECT_FALSE(exited_ok(status)) << c.expected;
    EXPECT_NE(ch.log().find(c.expected), std::string::npos) << ch.log();
  }
  fs::remove_all(dir);
}
