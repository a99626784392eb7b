// Exit codes and messages of bad command lines, config files and checkpoints, as the README's table states them:
// 2 for a usage error (naming the option or key and the value), 1 for bad data such as a checkpoint's corrupt
// config.yaml. Each case must end quickly: a FIFO no one writes to is refused, not waited on.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "distributed/process.h"

namespace fs = std::filesystem;
using dcp::test::Child;

namespace {

fs::path make_workdir(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / ("dcp_cli_usage_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

struct Case {
  std::vector<std::string> args;  // after the binary
  int code;                       // expected exit code
  std::string message;            // expected in the output
};

// Runs every case (at most 60 s each) and checks its exit code and message.
void expect_cases(const fs::path& dir, const std::vector<Case>& cases) {
  for (const Case& c : cases) {
    std::vector<std::string> args = {DCP_BINARY};
    args.insert(args.end(), c.args.begin(), c.args.end());
    std::string line;
    for (const auto& a : c.args) line += " " + a;
    Child ch = Child::spawn(args, {{"OMP_NUM_THREADS", "1"}}, (dir / "case.log").string());
    const int status = ch.wait(60);
    ASSERT_GE(status, 0) << "timed out:" << line;
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == c.code)
        << "dcp" << line << ": expected exit " << c.code << ", got status " << status << "\n" << ch.log();
    EXPECT_NE(ch.log().find(c.message), std::string::npos) << "dcp" << line << "\n" << ch.log();
  }
}

const std::vector<std::string> kTiny = {"--model.d_model=32", "--model.n_layers=1",         "--model.n_heads=2",
                                        "--model.d_ff=64",    "--data.max_seq_len=128",     "--train.threads=1",
                                        "--train.micro_batch_tokens=512", "--train.max_steps=2", "--eval.max_tokens=512",
                                        "--train.cost_model=h200"};

std::vector<std::string> train(const fs::path& dir, std::vector<std::string> extra) {
  std::vector<std::string> a = {"train", "--data.path=" + (dir / "corpus.jsonl").string(),
                                "--run.dir=" + (dir / "run").string()};
  a.insert(a.end(), kTiny.begin(), kTiny.end());
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

const std::vector<std::string> kPlan = {"plan", "--workload", "uniform", "--world-size", "4", "--num-samples", "64"};

std::vector<std::string> plan(std::vector<std::string> extra, std::vector<std::string> base = kPlan) {
  base.insert(base.end(), extra.begin(), extra.end());
  return base;
}

}  // namespace

// R17: config and usage errors that exited 1; a corrupt checkpoint config.yaml that exited 2.
TEST(CliUsage, ConfigAndOptionErrorsExit2AndCheckpointContentExits1) {
  const fs::path dir = make_workdir("codes");
  {
    std::ofstream corpus(dir / "corpus.jsonl");
    for (int i = 0; i < 50; ++i) corpus << nlohmann::json({{"text", "document " + std::to_string(i)}}).dump() << "\n";
  }
  {
    // A real checkpoint whose config.yaml is then corrupted (without its manifest, which would name the CRC32
    // first): every other file verifies, so the config is what is refused.
    std::vector<std::string> args = {DCP_BINARY};
    const auto t = train(dir, {});
    args.insert(args.end(), t.begin(), t.end());
    Child first = Child::spawn(args, {{"OMP_NUM_THREADS", "1"}}, (dir / "first.log").string());
    ASSERT_TRUE(dcp::test::exited_ok(first.wait(120))) << first.log();
    fs::copy(dir / "run" / "checkpoint", dir / "ckpt", fs::copy_options::recursive);
    fs::remove_all(dir / "run" / "checkpoint.old");  // else a load falls back to it
  }
  for (const fs::path& ckpt : {dir / "ckpt", dir / "run" / "checkpoint"}) {  // a checkpoint with a corrupt config
    fs::remove(ckpt / "manifest.json");
    std::ofstream(ckpt / "config.yaml") << "::\n";
  }
  const std::string plan_file = std::string(DCP_SOURCE_DIR) + "/docs/examples/plan_world2_dp_then_sp.json";
  expect_cases(dir, {
      {train(dir, {"--parallel.sp_sizes=foo"}), 2, "config key 'parallel.sp_sizes': bad value 'foo'"},
      {train(dir, {"--parallel.sp_size=2"}), 2, "config key 'parallel.sp_size': bad value '2'"},
      {{"simulate", "--workload", "uniform", "--world-size", "4", "--planners", "foo"}, 2,
       "--planners 'foo': unknown planner 'foo'"},
      {{"simulate", "--workload", "zipf", "--world-size", "4"}, 2, "--workload 'zipf'"},
      {plan({"--planner", "foo"}), 2, "--planner: unknown planner 'foo'"},
      {plan({"--static-sp", "3"}), 2, "--static-sp 3: must divide --world-size 4"},
      {plan({"--cost-model", "a100"}), 2, "--cost-model: unknown device 'a100'"},
      {{"verify-plan", "--plan-file", plan_file, "--step", "-1"}, 2, "--step -1: plan file"},
      {{"verify-plan", "--plan-file", plan_file, "--step", "99"}, 2, "--step 99: plan file"},
      {{"generate", "--checkpoint", (dir / "ckpt").string(), "--prompt", "x"}, 1, "config.yaml' is not a valid dcp config"},
      {train(dir, {"--resume"}), 1, "config.yaml' is not a valid dcp config"},
  });
  fs::remove_all(dir);
}

// R14, R16, R18: numbers out of range, NaN included, exit 2 naming the option or key.
TEST(CliUsage, NumberOptionsRefuseNanAndOutOfRangeValues) {
  const fs::path dir = make_workdir("numbers");
  const std::string plan_file = std::string(DCP_SOURCE_DIR) + "/docs/examples/plan_world2_dp_then_sp.json";
  std::vector<std::string> simulate = kPlan;
  simulate[0] = "simulate";
  expect_cases(dir, {
      {plan({"--num-samples", "9223372036854775807"}), 2, "--num-samples"},
      {plan({"--num-samples", "10000001"}), 2, "--num-samples"},
      {plan({"--num-samples", "9223372036854775807"}, simulate), 2, "--num-samples"},
      {plan({"--mfu", "nan"}), 2, "--mfu: must be a positive finite number in [0.001, 1], got 'nan'"},
      {plan({"--memory-budget-bytes", "nan"}), 2, "--memory-budget-bytes: must be a non-negative finite number"},
      {{"generate", "--checkpoint", dir.string(), "--temperature", "nan"}, 2,
       "--temperature: must be a non-negative finite number (at most 100), got 'nan'"},
      {{"verify-plan", "--plan-file", plan_file, "--tolerance", "nan"}, 2,
       "--tolerance: must be a positive finite number in [1e-12, 1], got 'nan'"},
      {{"launch", "--grace", "nan", "--", "true"}, 2,
       "--grace: must be a non-negative finite number of seconds (at most 3600), got 'nan'"},
      {{"bench", "--grace", "inf"}, 2, "--grace: must be a non-negative finite number of seconds"},
      {{"launch", "--nproc", "2", "--master-port", "abc", "--", "true"}, 2,
       "--master-port: 'abc' is not a number (allowed: a port number in [1, 65535])"},
      {{"launch", "--master-port", "70000", "--", "true"}, 2, "--master-port: 70000 is out of range"},
      {{"launch", "--max-restarts", "-1", "--", "true"}, 2, "--max-restarts: -1 is out of range"},
      {{"launch", "--restart-backoff-s", "nan", "--", "true"}, 2, "--restart-backoff-s: must be a non-negative finite"},
      // bench-serve's pairs of batching runs: refused while parsing, before the checkpoint is read.
      {{"bench-serve", "--checkpoint", dir.string(), "--out", (dir / "bs").string(), "--batching-repeats", "0"}, 2,
       "--batching-repeats: Value 0 not in range 1 to 100"},
      {{"bench-serve", "--checkpoint", dir.string(), "--out", (dir / "bs").string(), "--batching-repeats", "abc"}, 2,
       "--batching-repeats"},
      {{"bench-serve", "--checkpoint", dir.string(), "--out", (dir / "bs").string(), "--client-priority", "high"}, 2,
       "--client-priority: high not in {idle,normal}"},
      {{"train", "--train.grad_clip=1e39"}, 2, "config key 'train.grad_clip': bad value '1e39'"},
  });
  fs::remove_all(dir);
}

// R13: a huge but allowed budget plans (it overflowed int64); R19: a --cost-model that is a folder or a FIFO is
// named as such (it said "no such file"), and the FIFO is never opened.
TEST(CliUsage, HugeBudgetsPlanAndCostModelFoldersAndFifosAreNamed) {
  const fs::path dir = make_workdir("cost");
  ASSERT_EQ(mkfifo((dir / "profile.json").c_str(), 0600), 0);
  expect_cases(dir, {
      {plan({"--planner", "dcp-opt", "--memory-budget-bytes", "1e300"}), 0, "planner dcp-opt on uniform"},
      {plan({"--planner", "dcp-opt", "--memory.budget_bytes=1e25"}), 0, "planner dcp-opt on uniform"},
      {plan({"--cost-model", dir.string()}), 1, "is a folder, not the JSON file `dcp profile` writes"},
      {plan({"--cost-model", (dir / "profile.json").string()}), 1, "is not a regular file (a FIFO"},
  });
  fs::remove_all(dir);
}

// The lower bound `dcp simulate` reports for a planner holds for that planner's plans: --sp-modes restricts dcp-opt
// only (the other planners plan Ulysses groups), so their bound is over every mode. With ring only it was not:
// 16 samples of 131072 tokens on 2 ranks, dcp-inter-pac's plans predicted 13.8 s against a "bound" of 15.0 s.
TEST(CliUsage, SimulatedLowerBoundHoldsForEveryPlannerUnderSpModes) {
  const fs::path dir = make_workdir("bound_modes");
  {
    std::ofstream f(dir / "lengths.txt");
    for (int i = 0; i < 16; ++i) f << 131072 << "\n";
  }
  for (const char* modes : {"ring", "ulysses", "ring,ulysses-ring"}) {
    std::vector<std::string> args = {DCP_BINARY, "simulate", "--lengths", (dir / "lengths.txt").string(),
                                     "--world-size", "2", "--cost-model", "h200", "--planners",
                                     "packed,bucket,dcp-inter-pac,dcp-opt", "--sp-modes", modes, "--json"};
    Child ch = Child::spawn(args, {{"OMP_NUM_THREADS", "1"}}, (dir / "simulate.log").string());
    const int status = ch.wait(60);
    ASSERT_GE(status, 0) << "timed out";
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << ch.log();
    const std::string log = ch.log();
    const size_t a = log.find('['), b = log.rfind(']');
    ASSERT_TRUE(a != std::string::npos && b != std::string::npos && b > a) << log;
    const nlohmann::json rows = nlohmann::json::parse(log.substr(a, b - a + 1));
    ASSERT_EQ(rows.size(), 4u) << log;
    for (const auto& row : rows) {
      EXPECT_LE(row.at("lower_bound_ratio").get<double>(), 1 + 1e-9) << modes << ": " << row.dump();
    }
  }
  fs::remove_all(dir);
}

// A sample that fits no SP size is skipped by the planner: dcp plan names how many, their lengths and ids, and the
// budget (on stdout, and on stderr with --json, whose stdout is only the plans). A --lengths file that holds no
// length or a bad line is bad data (exit 1, naming the file and the line); a missing one is a usage error (exit 2).
TEST(CliUsage, PlanNamesSkippedSamplesAndBadLengthsFiles) {
  const fs::path dir = make_workdir("skipped");
  std::ofstream(dir / "lengths.txt") << "100\n2000000000\n300\n";
  std::ofstream(dir / "empty.txt") << "\n  \n";
  std::ofstream(dir / "bad.txt") << "100\n12x\n";
  const std::string lengths = (dir / "lengths.txt").string();
  const std::string skipped = "skipped 1 of 3 samples (2000000000 tokens; sample ids 1, counted from 0 over the "
                              "lengths in order): they fit no SP size within the per-rank planning budget of";
  expect_cases(dir, {
      {{"plan", "--lengths", lengths, "--world-size", "4"}, 0, skipped},
      {{"plan", "--lengths", lengths, "--world-size", "4", "--json"}, 0, "dcp plan: " + skipped},
      {{"plan", "--lengths", (dir / "empty.txt").string(), "--world-size", "4"}, 1, "holds no length"},
      {{"plan", "--lengths", (dir / "bad.txt").string(), "--world-size", "4"}, 1,
       "line 2: '12x' is not a positive integer"},
      {{"plan", "--lengths", (dir / "missing.txt").string(), "--world-size", "4"}, 2, "missing.txt"},
  });
  fs::remove_all(dir);
}

// R21: a plan that uses a sample twice is refused by verify-plan, naming the sample and both places.
TEST(CliUsage, VerifyPlanRefusesASampleUsedTwice) {
  const fs::path dir = make_workdir("dup_sample");
  std::ifstream in(std::string(DCP_SOURCE_DIR) + "/docs/examples/plan_world2_dp_then_sp.json");
  nlohmann::json plans = nlohmann::json::parse(in);
  const int64_t id = plans[0]["groups"][0]["micro_batches"][0]["sample_ids"][0];
  plans[0]["groups"][1]["micro_batches"][0]["sample_ids"].push_back(id);
  std::ofstream(dir / "dup.json") << plans.dump(1);
  const std::string src = DCP_SOURCE_DIR;
  expect_cases(dir, {{{"verify-plan", "--plan-file", (dir / "dup.json").string(), "--nproc", "2", "--config",
                       src + "/docs/examples/verify.yaml", "--data.path=" + src + "/docs/examples/corpus.jsonl",
                       "--run.dir=" + (dir / "run").string()},
                      1,
                      "sample id " + std::to_string(id) +
                          " is used twice: in micro_batch 0 of the group at rank 0 and in micro_batch 0 of the "
                          "group at rank 1"}});
  fs::remove_all(dir);
}

// R22, R23: a config file with a key given twice, a FIFO no one writes to, a device: exit 2, never a hang.
TEST(CliUsage, ConfigFilesWithDuplicateKeysFifosAndDevicesAreRefused) {
  const fs::path dir = make_workdir("config_files");
  std::ofstream(dir / "dup.yaml") << "train:\n  max_steps: 2\n  max_steps: 3\n";
  ASSERT_EQ(mkfifo((dir / "fifo.yaml").c_str(), 0600), 0);
  const auto start = std::chrono::steady_clock::now();
  expect_cases(dir, {
      {{"train", "--config", (dir / "dup.yaml").string()}, 2, "key 'train.max_steps' is given twice (lines 2 and 3)"},
      {{"train", "--config", (dir / "fifo.yaml").string()}, 2, "is a pipe with nothing to read after 2 s"},
      {{"train", "--config", "/dev/null"}, 2, "'/dev/null' is not a regular file (a device or a socket)"},
  });
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30.0);
  fs::remove_all(dir);
}
