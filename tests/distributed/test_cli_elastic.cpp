// `dcp launch --max-restarts` on one host (issue 30): a killed rank restarts the job from its last good checkpoint
// and the run ends as an uninterrupted one; a failure before the first checkpoint restarts from scratch; what a
// restart would meet again (a usage error, a refused checkpoint, a second non-finite stop) is not restarted; the
// restarts are bounded. Policy cases use a shell script as the ranks' program (it writes DCP_ERROR_FILE as dcp
// does), so that they take seconds.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>

#include "distributed/cli_run.h"
#include "distributed/process.h"

namespace fs = std::filesystem;
using dcp::test::Child;
using dcp::test::exited_ok;
using namespace dcp::test::cli;
using nlohmann::json;

namespace {

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

std::vector<std::string> elastic(int nproc, int max_restarts, const std::vector<std::string>& cmd) {
  std::vector<std::string> a = {DCP_BINARY,       "launch",      "--nproc", std::to_string(nproc), "--grace", "3",
                                "--max-restarts", std::to_string(max_restarts), "--restart-backoff-s", "0.2", "--"};
  a.insert(a.end(), cmd.begin(), cmd.end());
  return a;
}

// The pid of the rank `rank` (a `dcp train` child of launcher `launcher`), or -1.
pid_t rank_pid(pid_t launcher, int rank) {
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const size_t close = text.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(text.substr(close + 2));
    char state = 0;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid != launcher) continue;
    std::ifstream env(entry.path() / "environ");
    std::string environ_text((std::istreambuf_iterator<char>(env)), std::istreambuf_iterator<char>());
    if (environ_text.find(std::string("\0RANK=", 6) + std::to_string(rank) + '\0') != std::string::npos) {
      return std::stoi(name);
    }
  }
  return -1;
}

}  // namespace

// A rank killed mid-run: the launcher restarts both ranks with --resume from the last checkpoint; the losses of
// every step and the final model.pt equal an uninterrupted run's bit for bit (fp32); summary.json counts it.
TEST(ElasticLaunch, AKilledRankRestartsFromTheLastCheckpointAndMatchesAnUninterruptedRun) {
  const fs::path dir = make_workdir("elastic_kill");
  const std::vector<std::string> common = {"--train.max_steps=10", "--train.checkpoint_every=2",
                                           "--train.precision=fp32", "--dist.timeout_s=8"};
  auto ref_args = common;
  ref_args.push_back("--run.dir=" + (dir / "ref").string());
  Child ref = Child::spawn(launch(2, train_args(dir, ref_args)), {{"OMP_NUM_THREADS", "1"}}, (dir / "ref.log").string());
  ASSERT_TRUE(exited_ok(ref.wait(240))) << ref.log();

  auto args = common;
  args.push_back("--run.dir=" + (dir / "run").string());
  Child l = Child::spawn(elastic(2, 2, train_args(dir, args)), {{"OMP_NUM_THREADS", "1"}}, (dir / "run.log").string());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (count_lines(dir / "run" / "metrics.jsonl") < 3 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const pid_t victim = rank_pid(l.pid, 1);
  ASSERT_GT(victim, 0) << l.log();
  kill(victim, SIGKILL);
  const int status = l.wait(240);
  const std::string log = l.log();
  ASSERT_TRUE(exited_ok(status)) << log;
  EXPECT_EQ(count_of(log, "dcp launch: restart "), 1u) << log;
  EXPECT_NE(log.find("dcp launch: restart 1 of at most 2: rank 1 (node 0, pid " + std::to_string(victim) +
                     ") was killed by signal 9 (Killed); resuming from the last good checkpoint (the newest written "
                     "is step "),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("with --resume"), std::string::npos) << log;
  EXPECT_EQ(losses(dir / "run" / "metrics.jsonl"), losses(dir / "ref" / "metrics.jsonl"));
  EXPECT_EQ(count_lines(dir / "run" / "metrics.jsonl"), 10);
  EXPECT_EQ(read_text(dir / "run" / "checkpoint" / "model.pt"), read_text(dir / "ref" / "checkpoint" / "model.pt"));
  EXPECT_EQ(json::parse(read_text(dir / "run" / "summary.json")).at("restarts"), 1);
  EXPECT_EQ(json::parse(read_text(dir / "ref" / "summary.json")).at("restarts"), 0);
  fs::remove_all(dir);
}

// The restart policy, with a script as the ranks' program: DCP_RESTART_COUNT tells the round.
TEST(ElasticLaunch, RestartsFollowThePolicyAndAreBounded) {
  const fs::path dir = make_workdir("elastic_policy");
  struct Case {
    std::string name, script;
    int max_restarts, code;
    size_t restarts;
    std::string message;
  };
  const std::string error_file = "printf '{\"kind\": \"%s\", \"exit_code\": 1, \"message\": \"%s\"}' ";
  const std::vector<Case> cases = {
      // rank 1 fails in round 0 (before any checkpoint): one restart, from scratch, then success.
      {"scratch", "if [ \"$DCP_RESTART_COUNT\" = 0 ] && [ \"$RANK\" = 1 ]; then exit 3; fi; exit 0", 3, 0, 1,
       "dcp launch: restart 1 of at most 3: rank 1 (node 0, pid "},
      // always failing: bounded, and the last failure's code ends the job.
      {"bounded", "if [ \"$RANK\" = 0 ]; then exit 5; fi; sleep 30", 2, 5, 2, "not restarting: --max-restarts 2 used up; exit code 5"},
      // a usage error (exit 2) is never restarted.
      {"usage", "exit 2", 3, 2, 0, "not restarting: a usage or config error (exit 2) would come again; exit code 2"},
      // a refused checkpoint (as dcp's main() writes it to DCP_ERROR_FILE) is never restarted.
      {"refused", error_file + "checkpoint_refused 'checkpoint x is corrupt' > \"$DCP_ERROR_FILE\"; exit 1", 3, 1, 0,
       "(node 0, pid "},
      // a non-finite-loss stop is restarted once, not twice.
      {"nonfinite", error_file + "nonfinite 'step 3: the loss is nan' > \"$DCP_ERROR_FILE\"; exit 1", 3, 1, 1,
       "a non-finite loss stopped the run again after a restart (it is restarted at most once)"},
  };
  for (const Case& c : cases) {
    Child l = Child::spawn(elastic(2, c.max_restarts, {"/bin/sh", "-c", c.script}), {},
                           (dir / (c.name + ".log")).string());
    const int status = l.wait(90);
    const std::string log = l.log();
    ASSERT_GE(status, 0) << c.name << " hung:\n" << log;
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == c.code) << c.name << ": status " << status << "\n" << log;
    EXPECT_EQ(count_of(log, "dcp launch: restart "), c.restarts) << c.name << "\n" << log;
    EXPECT_NE(log.find(c.message), std::string::npos) << c.name << "\n" << log;
    if (c.name == "scratch") {
      EXPECT_NE(log.find("no checkpoint was written yet: restarting from scratch"), std::string::npos) << log;
    }
    if (c.name == "refused") {
      EXPECT_NE(log.find("checkpoint x is corrupt"), std::string::npos) << log;
      EXPECT_NE(log.find("not restarting: the checkpoint was refused, and would be again"), std::string::npos) << log;
    }
  }
  fs::remove_all(dir);
}

// dcp train's own failures carry their kind to the launcher: a config error exits 2 and a resume without a
// checkpoint is refused, neither restarted.
TEST(ElasticLaunch, TrainsDeterministicFailuresAreNotRestarted) {
  const fs::path dir = make_workdir("elastic_train_policy");
  Child usage = Child::spawn(elastic(2, 3, train_args(dir, {"--model.n_layers=-2"})), {{"OMP_NUM_THREADS", "1"}},
                             (dir / "usage.log").string());
  int status = usage.wait(120);
  EXPECT_TRUE(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 2) << usage.log();
  EXPECT_EQ(count_of(usage.log(), "dcp launch: restart "), 0u) << usage.log();
  EXPECT_NE(usage.log().find("config key 'model.n_layers'"), std::string::npos) << usage.log();

  Child refused = Child::spawn(elastic(2, 3, train_args(dir, {"--resume", "--run.dir=" + (dir / "empty").string()})),
                               {{"OMP_NUM_THREADS", "1"}}, (dir / "refused.log").string());
  status = refused.wait(120);
  EXPECT_TRUE(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 1) << refused.log();
  EXPECT_EQ(count_of(refused.log(), "dcp launch: restart "), 0u) << refused.log();
  EXPECT_NE(refused.log().find("not restarting: the checkpoint was refused"), std::string::npos) << refused.log();
  fs::remove_all(dir);
}
