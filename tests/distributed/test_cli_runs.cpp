// End-to-end runs of the dcp binary: launcher, resume, and what happens when a rank dies or hangs.
#include <gtest/gtest.h>

#include <fcntl.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "distributed/cli_run.h"
#include "distributed/process.h"

namespace fs = std::filesystem;
using dcp::test::Child;
using dcp::test::exited_ok;
using namespace dcp::test::cli;

namespace {

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
  // that of the same mean token loss, so the loss curve must agree up to float summation order. In fp32: bf16
  // rounds differently for the different matmul shapes of different plans.
  fs::path dir = make_workdir("planners");
  std::map<std::string, std::vector<double>> curves;
  for (const std::string planner : {"static", "dcp-opt", "packed"}) {
    Child c = Child::spawn(launch(2, train_args(dir, {"--train.max_steps=3", "--train.precision=fp32",
                                                      "--train.planner=" + planner,
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

TEST(CliRuns, RingSpTwoTrainsLikeUlyssesSpTwoAndOneRank) {
  // The static layout with parallel.sp_mode ring: the same steps as Ulysses sp 2 and as two data-parallel ranks,
  // so the step-1 loss (same weights) agrees to float summation order, and the later ones stay together.
  fs::path dir = make_workdir("ring");
  std::map<std::string, std::vector<double>> curves;
  const std::vector<std::pair<std::string, std::vector<std::string>>> runs = {
      {"sp1", {"--parallel.sp_size=1"}},
      {"ulysses2", {"--parallel.sp_size=2"}},
      {"ring2", {"--parallel.sp_size=2", "--parallel.sp_mode=ring"}}};
  for (const auto& [name, extra] : runs) {
    std::vector<std::string> args = {"--train.max_steps=3", "--train.precision=fp32", "--train.planner=static",
                                     "--run.dir=" + (dir / name).string()};
    args.insert(args.end(), extra.begin(), extra.end());
    Child c = Child::spawn(launch(2, train_args(dir, args)), {}, (dir / (name + ".log")).string());
    ASSERT_TRUE(exited_ok(c.wait(240))) << c.log();
    curves[name] = losses(dir / name / "metrics.jsonl");
    ASSERT_EQ(curves[name].size(), 3u) << name;
  }
  for (const auto& [name, curve] : curves) {
    EXPECT_NEAR(curve[0], curves["sp1"][0], 1e-5 * curves["sp1"][0]) << name << " step 1";
    for (size_t i = 1; i < curve.size(); ++i) {
      EXPECT_NEAR(curve[i], curves["sp1"][i], 1e-4 * curves["sp1"][i]) << name << " step " << i + 1;
    }
  }
  fs::remove_all(dir);
}

TEST(CliRuns, Bf16TrainingTrainsLikeFp32AndRecordsItsPrecision) {
  // Two ranks in one SP group (q, k, v cross the all-to-all in bf16), one layer recomputed, a few steps.
  fs::path dir = make_workdir("bf16");
  std::map<std::string, std::vector<double>> curves;
  for (const std::string precision : {"bf16", "fp32"}) {
    Child c = Child::spawn(
        launch(2, train_args(dir, {"--train.max_steps=5", "--train.warmup_steps=0", "--parallel.sp_size=2",
                                   "--model.recompute_layers=1", "--train.precision=" + precision,
                                   "--run.dir=" + (dir / precision).string()})),
        {}, (dir / (precision + ".log")).string());
    ASSERT_TRUE(exited_ok(c.wait(240))) << c.log();
    EXPECT_NE(c.log().find("precision: " + precision + " (train.precision=" + precision + ")"), std::string::npos)
        << c.log();
    const auto summary = nlohmann::json::parse(std::ifstream(dir / precision / "summary.json"));
    EXPECT_EQ(summary.at("precision"), precision);
    // Model FLOPs (the same plans, so the same count in both precisions) and their rate.
    EXPECT_GT(summary.at("model_flops_per_s").get<double>(), 0);
    std::ifstream metrics(dir / precision / "metrics.jsonl");
    std::string first;
    std::getline(metrics, first);
    EXPECT_GT(nlohmann::json::parse(first).at("model_flops").get<double>(), 0);
    EXPECT_LT(summary.at("heldout_bits_per_byte_final").get<double>(),
              summary.at("heldout_bits_per_byte_initial").get<double>());
    curves[precision] = losses(dir / precision / "metrics.jsonl");
  }
  const auto& bf16 = curves["bf16"];
  ASSERT_EQ(bf16.size(), 5u);
  EXPECT_LT(bf16.back(), 0.95 * bf16.front()) << "bf16 training does not lower the loss";
  for (size_t i = 0; i < bf16.size(); ++i) {
    EXPECT_TRUE(std::isfinite(bf16[i])) << "step " << i + 1;
    // Same weights, data and plans: bf16 rounding moves the loss curve by far less than 1% in 5 steps.
    EXPECT_NEAR(bf16[i], curves["fp32"][i], 1e-2 * curves["fp32"][i]) << "step " << i + 1;
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
  auto [s2b, log2b] = run({"--resume", "--attention.backend=flexformer"}, "changed_attention.log");
  EXPECT_FALSE(exited_ok(s2b));
  EXPECT_NE(log2b.find("'attention.backend' is 'softmax' there but 'flexformer' now"), std::string::npos) << log2b;
  // A refused cost model is found before the run_dir's files are touched: the stopped run stays resumable.
  auto slurp = [](const fs::path& p) { std::ifstream in(p); std::stringstream t; t << in.rdbuf(); return t.str(); };
  const std::string config_before = slurp(dir / "run" / "config.yaml");
  auto [s2c, log2c] = run({"--train.cost_model=" + (dir / "missing.json").string()}, "missing_profile.log");
  EXPECT_FALSE(exited_ok(s2c));
  EXPECT_NE(log2c.find("missing.json"), std::string::npos) << log2c;
  EXPECT_EQ(count_lines(dir / "run" / "metrics.jsonl"), 1);
  EXPECT_EQ(slurp(dir / "run" / "config.yaml"), config_before);
  auto [s3, log3] = run({"--resume"}, "resumed.log");
  ASSERT_TRUE(exited_ok(s3)) << log3;
  EXPECT_EQ(count_lines(dir / "run" / "metrics.jsonl"), 2);
  fs::remove_all(dir);
}

TEST(CliRuns, AutoCostModelProfilesOnceAndReprofilesACorruptOrOtherKeyCache) {
  fs::path dir = make_workdir("auto_cost");
  const fs::path cache = dir / "cache";
  auto run = [&](const std::string& name, const std::vector<std::string>& extra) {
    std::vector<std::string> args = {"--train.max_steps=2", "--train.planner=dcp-opt", "--train.cost_model=auto",
                                     "--train.profile_dir=" + cache.string(), "--run.dir=" + (dir / name).string()};
    args.insert(args.end(), extra.begin(), extra.end());
    Child c = Child::spawn(launch(2, train_args(dir, args)), {}, (dir / (name + ".log")).string());
    const int status = c.wait(180);
    return std::make_pair(status, c.log());
  };
  auto cache_files = [&] {  // the profiles (their .lock files stay beside them)
    std::vector<fs::path> out;
    for (const auto& e : fs::directory_iterator(cache)) {
      if (e.path().extension() == ".json") out.push_back(e.path());
    }
    return out;
  };
  // The reason for profiling is logged before the profile starts, not only after it.
  auto reason_before_profile = [](const std::string& log, const std::string& reason) {
    const size_t at = log.find("train.cost_model auto: profiling this model on every rank: " + reason);
    return at != std::string::npos && at < log.find("train.cost_model auto: profiled this model in");
  };
  auto [s1, log1] = run("first", {});
  ASSERT_TRUE(exited_ok(s1)) << log1;
  EXPECT_TRUE(reason_before_profile(log1, "no cached profile for this key in '" + cache.string() + "'")) << log1;
  ASSERT_EQ(cache_files().size(), 1u);
  const fs::path file = cache_files()[0];
  EXPECT_TRUE(fs::exists(file.string() + ".lock"));
  const auto summary = nlohmann::json::parse(std::ifstream(dir / "first" / "summary.json"));
  EXPECT_EQ(summary.at("cost_model_file"), file.string());
  EXPECT_EQ(summary.at("memory_model"), "profile");
  const auto doc = nlohmann::json::parse(std::ifstream(file));
  EXPECT_EQ(doc.at("cache_key").at("world_size"), 2);
  EXPECT_EQ(doc.at("cache_key").at("threads_per_rank"), 1);
  EXPECT_EQ(doc.at("cache_key").at("micro_batch_tokens"), 512);
  // Only the SP sizes of parallel.sp_sizes that divide the heads: sp 2 on 2 ranks with 2 heads.
  ASSERT_EQ(doc.at("sequence_parallel").at("fits").size(), 1u);
  EXPECT_EQ(doc.at("sequence_parallel").at("fits")[0].at("sp_size"), 2);

  auto [s2, log2] = run("second", {});
  ASSERT_TRUE(exited_ok(s2)) << log2;
  EXPECT_NE(log2.find("train.cost_model auto: cached profile " + file.string()), std::string::npos) << log2;
  EXPECT_EQ(log2.find("profiled this model"), std::string::npos) << log2;

  fs::resize_file(file, fs::file_size(file) / 2);  // a crash of an older writer, a full disk
  auto [s3, log3] = run("corrupt", {});
  ASSERT_TRUE(exited_ok(s3)) << log3;
  EXPECT_TRUE(reason_before_profile(log3, "cache file '" + file.string() + "' is corrupt")) << log3;
  EXPECT_NO_THROW(nlohmann::json::parse(std::ifstream(file)));  // re-profiled and rewritten whole

  // train.micro_batch_tokens sets the grid's micro-batch sizes, so it is part of the key; the log names the
  // field in which the closest cached profile differs.
  auto [s4, log4] = run("other_grid", {"--train.micro_batch_tokens=1024"});
  ASSERT_TRUE(exited_ok(s4)) << log4;
  EXPECT_TRUE(reason_before_profile(log4, "no cached profile for this key; the closest cached one, '" +
                                              file.string() + "': micro_batch_tokens 512 there, 1024 now"))
      << log4;
  EXPECT_EQ(cache_files().size(), 2u);
  fs::remove_all(dir);
}

TEST(CliRuns, AutoCostModelProfilesOnlyTheSpSizesOfParallelSpSizes) {
  // The static planner's parallel.sp_size 2 gets a process group, but the cache key names parallel.sp_sizes
  // (1 and the world size 4 always among them): the profile times sp 4 only.
  fs::path dir = make_workdir("auto_cost_sp");
  Child c = Child::spawn(launch(4, train_args(dir, {"--train.max_steps=1", "--model.n_heads=4",
                                                    "--parallel.sp_sizes=1,4", "--parallel.sp_size=2",
                                                    "--train.cost_model=auto",
                                                    "--train.profile_dir=" + (dir / "cache").string(),
                                                    "--dist.timeout_s=30"})),
                         {}, (dir / "run.log").string());
  ASSERT_TRUE(exited_ok(c.wait(240))) << c.log();
  const auto summary = nlohmann::json::parse(std::ifstream(dir / "run" / "summary.json"));
  const auto doc = nlohmann::json::parse(std::ifstream(summary.at("cost_model_file").get<std::string>()));
  const auto& fits = doc.at("sequence_parallel").at("fits");
  ASSERT_EQ(fits.size(), 1u) << fits.dump();
  EXPECT_EQ(fits[0].at("sp_size"), 4);
  fs::remove_all(dir);
}

TEST(CliRuns, AutoCostModelRefusesAnUnwritableProfileDirBeforeProfiling) {
  fs::path dir = make_workdir("auto_cost_dir");
  std::ofstream(dir / "a_file") << "x";
  // /proc exists and is a folder in which not even root can create a file; a_file is not a folder.
  for (const auto& [profile_dir, expected] :
       std::vector<std::pair<std::string, std::string>>{
           {"/proc", "train.profile_dir: cannot create a file in the folder '/proc'"},
           {(dir / "a_file").string(), "train.profile_dir: '" + (dir / "a_file").string() + "' is not a folder"}}) {
    Child c = Child::spawn(launch(2, train_args(dir, {"--train.max_steps=2", "--train.planner=dcp-opt",
                                                      "--train.cost_model=auto", "--train.profile_dir=" + profile_dir})),
                           {}, (dir / "run.log").string());
    const int status = c.wait(60);
    EXPECT_TRUE(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 2) << c.log();
    EXPECT_NE(c.log().find(expected), std::string::npos) << c.log();
    EXPECT_EQ(c.log().find("profiling this model"), std::string::npos) << c.log();
  }
  // Samples too short for the profile's grids: exit 2 before profiling, not a late exit 1 inside it.
  Child c = Child::spawn(launch(2, train_args(dir, {"--train.max_steps=2", "--train.planner=dcp-opt",
                                                    "--train.cost_model=auto", "--data.max_seq_len=3",
                                                    "--train.profile_dir=" + (dir / "cache").string()})),
                         {}, (dir / "short.log").string());
  const int status = c.wait(60);
  EXPECT_TRUE(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 2) << c.log();
  EXPECT_NE(c.log().find("train.cost_model auto: data.max_seq_len 3 is below"), std::string::npos) << c.log();
  fs::remove_all(dir);
}

TEST(CliRuns, TwoRunsSharingAProfileCacheProfileOnce) {
  // Both runs start at once: the first to take the cache's lock profiles, the other waits and uses its file.
  fs::path dir = make_workdir("auto_cost_shared");
  const fs::path cache = dir / "cache";
  auto start = [&](const std::string& name) {
    return Child::spawn(launch(2, train_args(dir, {"--train.max_steps=1", "--train.planner=dcp-opt",
                                                   "--train.cost_model=auto", "--train.profile_dir=" + cache.string(),
                                                   "--run.dir=" + (dir / name).string()})),
                        {}, (dir / (name + ".log")).string());
  };
  Child a = start("a"), b = start("b");
  const int status_a = a.wait(240), status_b = b.wait(240);
  ASSERT_TRUE(exited_ok(status_a)) << a.log();
  ASSERT_TRUE(exited_ok(status_b)) << b.log();
  const bool a_profiled = a.log().find("profiled this model in") != std::string::npos;
  const std::string& reused = a_profiled ? b.log() : a.log();
  EXPECT_NE((a_profiled ? a.log() : b.log()).find("profiled this model in"), std::string::npos);
  EXPECT_EQ(reused.find("profiled this model in"), std::string::npos) << reused;
  // "another run holds" is logged only when the second run reached the lock while the first profiled; on a
  // loaded machine it may start after the profile was written and find it cached, which is the same contract.
  EXPECT_NE(reused.find("train.cost_model auto: cached profile"), std::string::npos) << reused;
  int profiles = 0;
  for (const auto& e : fs::directory_iterator(cache)) profiles += e.path().extension() == ".json";
  EXPECT_EQ(profiles, 1);
  fs::remove_all(dir);
}

TEST(CliRuns, FittedMemoryModelKeepsMeasuredPeaksUnderTheBudget) {
  // Profile the test model, then train with its fitted memory model and a budget that admits a micro-batch of
  // 512 tokens without recompute: every rank's measured peak of every step must stay under it.
  fs::path dir = make_workdir("memory");
  std::vector<std::string> model = {"--model.d_model=32", "--model.n_layers=2", "--model.n_heads=2",
                                    "--model.d_ff=64", "--data.max_seq_len=128", "--train.threads=1"};
  std::vector<std::string> profile = {DCP_BINARY, "profile", "--out", (dir / "profile.json").string(),
                                      "--repeats", "1"};
  profile.insert(profile.end(), model.begin(), model.end());
  Child p = Child::spawn(profile, {}, (dir / "profile.log").string());
  ASSERT_TRUE(exited_ok(p.wait(120))) << p.log();
  const auto doc = nlohmann::json::parse(std::ifstream(dir / "profile.json"));
  const auto& m = doc.at("memory");
  const double base = m.at("base_bytes");
  const double budget =  // 512 tokens of samples up to 128 long, none of the 2 layers recomputed
      base + 512.0 * (2 * m.at("token_layer_bytes").get<double>()) +
      512.0 * 128.0 * (2 * m.at("square_layer_bytes").get<double>() + m.at("square_bytes").get<double>());

  auto train = [&](double budget_bytes, const std::string& name, const std::string& planner = "dcp-opt") {
    Child c = Child::spawn(launch(2, train_args(dir, {"--train.max_steps=4", "--train.planner=" + planner,
                                                      "--parallel.sp_size=0",  // static only: sized to the budget
                                                      "--train.cost_model=" + (dir / "profile.json").string(),
                                                      "--memory.budget_bytes=" + std::to_string(budget_bytes),
                                                      "--run.dir=" + (dir / name).string()})),
                           {}, (dir / (name + ".log")).string());
    const int status = c.wait(120);
    return std::make_pair(status, c.log());
  };
  auto [status, log] = train(budget, "fits");
  ASSERT_TRUE(exited_ok(status)) << log;
  const auto summary = nlohmann::json::parse(std::ifstream(dir / "fits" / "summary.json"));
  EXPECT_EQ(summary.at("memory_model"), "profile");
  EXPECT_NEAR(summary.at("memory_budget_bytes").get<double>(), budget, 1.0);
  int64_t max_peak = 0;
  std::ifstream metrics(dir / "fits" / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto peaks = nlohmann::json::parse(line).at("rank_peak_bytes").get<std::vector<int64_t>>();
    ASSERT_EQ(peaks.size(), 2u) << line;
    for (int64_t b : peaks) {
      EXPECT_GT(static_cast<double>(b), base / 2) << line;  // the resident state is counted
      max_peak = std::max(max_peak, b);
    }
  }
  EXPECT_EQ(summary.at("peak_bytes").get<int64_t>(), max_peak);
  // Steps whose measured peak passed the budget are counted and warned of (this tiny model's may: see below).
  if (static_cast<double>(max_peak) > summary.at("memory_budget_bytes").get<double>()) {
    EXPECT_GT(summary.at("steps_measured_over_budget").get<int64_t>(), 0) << summary.dump();
    EXPECT_NE(log.find("over the memory budget"), std::string::npos) << log;
  } else {
    EXPECT_EQ(summary.at("steps_measured_over_budget").get<int64_t>(), 0) << summary.dump();
  }
  // Within the memory model's error at this tiny size (peaks of 2-3 MB, where fixed buffers of 0.1-0.4 MB such
  // as the tiled attention's tiles matter; the affine fit under-predicts the grid's smallest points by ~3% and
  // the trainer's micro-batches, below the grid, by up to 9% measured). Issue 11 tightens the CPU memory model.
  EXPECT_LE(static_cast<double>(max_peak), 1.10 * summary.at("memory_budget_bytes").get<double>());

  // A budget below the model's resident state: exit 2 naming the bytes, not an endless loop over empty epochs.
  auto [small_status, small_log] = train(base / 2, "too_small");
  EXPECT_TRUE(WIFEXITED(small_status) && WEXITSTATUS(small_status) == 2) << small_log;
  EXPECT_NE(small_log.find("is below the model's resident bytes"), std::string::npos) << small_log;
  // Above the resident bytes but below any sample: exit 2 from the planner, and the earlier run in that run_dir
  // keeps its metrics.
  auto [none_status, none_log] = train(base + 64.0, "fits");
  EXPECT_TRUE(WIFEXITED(none_status) && WEXITSTATUS(none_status) == 2) << none_log;
  EXPECT_NE(none_log.find("no training sample fits the per-rank memory budget"), std::string::npos) << none_log;
  EXPECT_EQ(count_lines(dir / "fits" / "metrics.jsonl"), 4);
  // A budget between the short and the long samples: the long ones are skipped and counted, the run goes on.
  // A 100-token sample on sp 2 with both layers recomputed (MemoryCoefficients' formula, t = 50, Q = 100^2 / 2):
  // the corpus' 128-token chunks fit no layout, its shorter samples do.
  const double mid = base + 50.0 * (2 * m.at("token_recompute_bytes").get<double>() +
                                    m.at("sp_token_bytes").get<double>()) +
                     5000.0 * m.at("square_bytes").get<double>();
  auto [mid_status, mid_log] = train(mid, "some_fit");
  ASSERT_TRUE(exited_ok(mid_status)) << mid_log;
  const auto mid_summary = nlohmann::json::parse(std::ifstream(dir / "some_fit" / "summary.json"));
  EXPECT_GT(mid_summary.at("samples_skipped").value("exceeds_memory_budget", 0), 0) << mid_summary.dump();
  EXPECT_NE(mid_log.find("longer than the memory budget admits"), std::string::npos) << mid_log;
  // The static planner sized to the budget (parallel.sp_size 0) skips and counts the same samples instead of
  // refusing the run, and exits 2 only when no sample fits.
  auto [static_status, static_log] = train(mid, "static_some_fit", "static");
  ASSERT_TRUE(exited_ok(static_status)) << static_log;
  const auto static_summary = nlohmann::json::parse(std::ifstream(dir / "static_some_fit" / "summary.json"));
  EXPECT_GT(static_summary.at("samples_skipped").value("exceeds_memory_budget", 0), 0) << static_summary.dump();
  EXPECT_NE(static_log.find("planner static skips"), std::string::npos) << static_log;
  EXPECT_NE(static_log.find("static planner sized to the longest sample that fits"), std::string::npos) << static_log;
  auto [static_none, static_none_log] = train(base + 64.0, "static_none", "static");
  EXPECT_TRUE(WIFEXITED(static_none) && WEXITSTATUS(static_none) == 2) << static_none_log;
  EXPECT_NE(static_none_log.find("parallel.sp_size 0: no training sample fits"), std::string::npos) << static_none_log;
  fs::remove_all(dir);
}

TEST(CliRuns, TwoRankProfileFitsTheAllToAllAndChecksSpMicroBatches) {
  // `dcp profile` under the launcher: both ranks run the grid, the all-to-alls of the sp 2 group are fitted, and
  // real sp 2 micro-batches (lengths 2048 / 16, / 8, / 4, / 2, / 1, recompute 0 and 2) are timed, half of them
  // for the overhead fit and half held out.
  fs::path dir = make_workdir("sp_profile");
  const fs::path out = dir / "profile.json";
  Child p = Child::spawn(launch(2, {"profile", "--out", out.string(), "--repeats", "1", "--model.d_model=32",
                                    "--model.n_layers=2", "--model.n_heads=2", "--model.d_ff=64",
                                    "--data.max_seq_len=2048", "--train.micro_batch_tokens=2048",
                                    "--train.global_batch_tokens=4096", "--train.threads=1", "--dist.timeout_s=20"}),
                         {}, (dir / "profile.log").string());
  ASSERT_TRUE(exited_ok(p.wait(120))) << p.log();
  const auto doc = nlohmann::json::parse(std::ifstream(out));
  EXPECT_EQ(doc.at("world_size"), 2);
  EXPECT_EQ(doc.at("threads"), 1);
  const auto& fits = doc.at("sequence_parallel").at("fits");
  ASSERT_EQ(fits.size(), 1u) << fits.dump();
  EXPECT_EQ(fits[0].at("sp_size"), 2);
  EXPECT_GT(fits[0].at("bytes_per_s").get<double>(), 0.0);
  EXPECT_GE(fits[0].at("latency_s").get<double>(), 0.0);
  EXPECT_GE(fits[0].at("overhead_s_per_byte").get<double>(), 0.0);
  EXPECT_GE(fits[0].at("grid").size(), 4u);
  const auto& validation = doc.at("sequence_parallel").at("validation");
  ASSERT_EQ(validation.size(), 10u) << validation.dump();
  int held_out = 0;
  for (const auto& v : validation) {
    EXPECT_EQ(v.at("sp_size"), 2);
    EXPECT_GT(v.at("measured_s").get<double>(), 0.0);
    EXPECT_GT(v.at("predicted_s").get<double>(), 0.0);
    EXPECT_GT(v.at("measured_peak_bytes").get<double>(), 0.0);
    held_out += v.at("held_out").get<bool>();
  }
  EXPECT_EQ(held_out, 5);
  EXPECT_EQ(validation[0].at("sample_length"), 128);
  EXPECT_EQ(validation[9].at("sample_length"), 2048);
  EXPECT_EQ(validation[9].at("recompute_layers"), 2);
  EXPECT_NE(p.log().find("all-to-all fits"), std::string::npos) << p.log();
  fs::remove_all(dir);
}

TEST(CliRuns, ProfileChecksMaxLengthUpFrontAndNamesSkippedSpSizes) {
  fs::path dir = make_workdir("profile_checks");
  const std::vector<std::string> model = {"--model.d_model=32", "--model.n_layers=2", "--model.d_ff=64",
                                          "--data.max_seq_len=128", "--train.threads=1", "--dist.timeout_s=20"};
  auto profile = [&](const std::vector<std::string>& extra, int nproc) {
    std::vector<std::string> args = {"profile", "--out", (dir / "profile.json").string(), "--repeats", "1"};
    args.insert(args.end(), model.begin(), model.end());
    args.insert(args.end(), extra.begin(), extra.end());
    if (nproc == 1) {
      args.insert(args.begin(), DCP_BINARY);
    } else {
      args = launch(nproc, args);
    }
    Child c = Child::spawn(args, {}, (dir / "profile.log").string());
    const int status = c.wait(120);
    return std::make_pair(status, c.log());
  };
  // Too short for the grid, or longer than any sample: usage errors with the range, before anything runs.
  for (const char* length : {"1", "1000"}) {
    auto [status, log] = profile({"--max-length", length}, 1);
    EXPECT_TRUE(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 2) << log;
    EXPECT_NE(log.find("--max-length " + std::string(length) + ": outside the allowed range [4, 128]"),
              std::string::npos)
        << log;
    EXPECT_FALSE(fs::exists(dir / "profile.json"));
  }
  // One head cannot be split over the sp-2 group: that size is named, not silently left out.
  auto [status, log] = profile({"--model.n_heads=1"}, 2);
  ASSERT_TRUE(exited_ok(status)) << log;
  EXPECT_NE(log.find("1 SP size(s) of parallel.sp_sizes 'pow2' not profiled: 2 do(es) not divide model.n_heads 1"),
            std::string::npos)
      << log;
  // No all-to-all fit for it; a ring does not shard heads, so its ring step is fitted.
  const auto sp = nlohmann::json::parse(std::ifstream(dir / "profile.json")).at("sequence_parallel");
  EXPECT_TRUE(sp.at("fits").empty()) << sp.dump();
  ASSERT_EQ(sp.at("ring_fits").size(), 1u) << sp.dump();
  EXPECT_EQ(sp.at("ring_fits")[0].at("sp_size"), 2);
  EXPECT_GT(sp.at("ring_fits")[0].at("bytes_per_s").get<double>(), 0.0);
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

namespace {

// The pids of live processes whose command line is exactly `sleep <duration>`.
std::vector<pid_t> sleeps_of(const std::string& duration) {
  std::vector<pid_t> out;
  const std::string wanted = std::string("sleep") + '\0' + duration + '\0';
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(entry.path() / "cmdline");
    std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (cmdline == wanted) out.push_back(std::stoi(name));
  }
  return out;
}

// Polls until no `sleep <duration>` is left or `seconds` pass; kills what is left (so that a failure leaves
// nothing behind) and returns how many there were.
size_t survivors_after(const std::string& duration, double seconds) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(static_cast<int>(seconds * 1000));
  while (!sleeps_of(duration).empty() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  auto left = sleeps_of(duration);
  for (pid_t p : left) kill(p, SIGKILL);
  return left.size();
}

}  // namespace

// R11: a rank's own children (the shell's background `sleep`) go down with it, whether a rank fails or the
// launcher itself is killed with SIGKILL. Before the fix the launcher signalled only each rank's pid, so the
// sleep stayed, re-parented to init.
TEST(CliRuns, LauncherLeavesNoGrandchildBehind) {
  fs::path dir = make_workdir("grandchild");
  const std::string tag = std::to_string(getpid() % 100000);
  {  // rank 1 fails; rank 0 is a shell waiting on a background sleep
    const std::string duration = "77.5" + tag + "1";
    std::string script = "if [ \"$RANK\" = 1 ]; then sleep 1; exit 3; fi; sleep " + duration + " & wait";
    Child l = Child::spawn(launch(2, {"/bin/sh", "-c", script}), {}, (dir / "fail.log").string());
    int status = l.wait(30);
    ASSERT_NE(status, -1) << l.log();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 3) << l.log();
    EXPECT_EQ(survivors_after(duration, 2.0), 0u) << "a grandchild outlived a failed launch:\n" << l.log();
  }
  {  // the launcher gets SIGKILL while both ranks wait on their sleeps
    const std::string duration = "77.5" + tag + "2";
    Child l = Child::spawn(launch(2, {"/bin/sh", "-c", "sleep " + duration + " & wait"}), {},
                           (dir / "kill.log").string());
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (sleeps_of(duration).size() < 2 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ASSERT_EQ(sleeps_of(duration).size(), 2u) << l.log();
    l.kill_now();
    EXPECT_EQ(survivors_after(duration, 2.0), 0u) << "a grandchild outlived a launcher killed with SIGKILL";
  }
  {  // the launcher gets SIGTERM: it forwards it to the ranks' groups and exits 128 + 15
    const std::string duration = "77.5" + tag + "3";
    Child l = Child::spawn(launch(2, {"/bin/sh", "-c", "sleep " + duration + " & wait"}), {},
                           (dir / "term.log").string());
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (sleeps_of(duration).size() < 2 && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ASSERT_EQ(sleeps_of(duration).size(), 2u) << l.log();
    kill(l.pid, SIGTERM);
    int status = l.wait(10);
    EXPECT_TRUE(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 143) << l.log();
    EXPECT_EQ(survivors_after(duration, 2.0), 0u) << "a grandchild outlived a launcher stopped with SIGTERM";
  }
  fs::remove_all(dir);
}

// Multi-node: each node's launcher numbers its ranks node_rank * nproc + local rank out of nnodes * nproc.
TEST(CliRuns, LauncherSetsMultiNodeVariablesAndChecksItsOptions) {
  fs::path dir = make_workdir("nodes");
  const std::string print =
      "echo \"R=$RANK W=$WORLD_SIZE L=$LOCAL_RANK LW=$LOCAL_WORLD_SIZE A=$MASTER_ADDR P=$MASTER_PORT\"";
  Child l = Child::spawn({DCP_BINARY, "launch", "--nproc", "2", "--nnodes", "3", "--node-rank", "1", "--master-addr",
                          "localhost", "--master-port", "29123", "--", "/bin/sh", "-c", print},
                         {}, (dir / "vars.log").string());
  ASSERT_TRUE(exited_ok(l.wait(30))) << l.log();
  EXPECT_NE(l.log().find("R=2 W=6 L=0 LW=2 A=localhost P=29123"), std::string::npos) << l.log();
  EXPECT_NE(l.log().find("R=3 W=6 L=1 LW=2 A=localhost P=29123"), std::string::npos) << l.log();

  struct Case {
    std::vector<std::string> args;
    std::string expected;
  };
  std::vector<Case> cases = {
      {{"--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", "--master-port", "29123"},
       "--node-rank 2: must be in [0, 2)"},
      {{"--nnodes", "2", "--master-port", "29123"}, "--master-addr: required with --nnodes 2"},
      {{"--nnodes", "2", "--master-addr", "127.0.0.1"}, "--master-port: required with --nnodes 2"},
      {{"--nnodes", "2", "--master-addr", "no-such-host.invalid", "--master-port", "29123"},
       "--master-addr 'no-such-host.invalid': does not resolve"},
      {{"--master-port", "70000"}, "--master-port"},
      {{"--nnodes", "0"}, "--nnodes"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> args = {DCP_BINARY, "launch", "--nproc", "1"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    args.insert(args.end(), {"--", "/bin/true"});
    Child bad = Child::spawn(args, {}, (dir / "bad.log").string());
    int status = bad.wait(30);
    EXPECT_TRUE(status != -1 && WIFEXITED(status) && WEXITSTATUS(status) == 2) << c.expected << "\n" << bad.log();
    EXPECT_NE(bad.log().find(c.expected), std::string::npos) << bad.log();
  }
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

// dcp generate on a softmax checkpoint decodes through the KV cache; the prefill chunk changes nothing (fp32, greedy,
// 150 bytes: the 128-token window slides, so the cache is also rebuilt from slid windows).
TEST(CliRuns, GenerateDecodesThroughTheKvCacheWithAnyChunkSize) {
  fs::path dir = make_workdir("generate");
  std::vector<std::string> train = train_args(dir, {"--train.max_steps=2", "--train.precision=fp32"});
  train.insert(train.begin(), DCP_BINARY);
  Child trainer = Child::spawn(train, {}, (dir / "train.log").string());
  ASSERT_TRUE(exited_ok(trainer.wait(240))) << trainer.log();
  int status = 0;
  auto generate = [&](const std::string& chunk, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {DCP_BINARY, "generate", "--checkpoint", (dir / "run" / "checkpoint").string(),
                                     "--prompt", "Document 7: the", "--max-new-tokens", "150", "--temperature", "0"};
    if (!chunk.empty()) args.insert(args.end(), {"--chunk-tokens", chunk});
    args.insert(args.end(), extra.begin(), extra.end());
    Child g = Child::spawn(args, {}, (dir / ("generate" + chunk + std::to_string(extra.size()) + ".log")).string());
    status = g.wait(120);
    return std::pair{exited_ok(status), g.log()};
  };
  const auto by_config = generate("");  // kv.chunk_tokens of the checkpoint's config: 512
  ASSERT_TRUE(by_config.first) << by_config.second;
  EXPECT_EQ(by_config.second.rfind("Document 7: the", 0), 0u) << by_config.second;
  EXPECT_GT(by_config.second.size(), 150u);
  for (const char* chunk : {"1", "7"}) {
    const auto other = generate(chunk);
    ASSERT_TRUE(other.first) << other.second;
    EXPECT_EQ(other.second, by_config.second) << "chunk " << chunk;
  }
  const auto bad = generate("0");
  EXPECT_FALSE(bad.first);
  EXPECT_NE(bad.second.find("chunk_tokens"), std::string::npos) << bad.second;  // --kv.chunk_tokens, alias --chunk-tokens
  // A compression policy from the command line: budget 1 is the full cache; a real budget still generates.
  const auto kept = generate("", {"--kv.policy", "minimax", "--kv.budget", "1"});
  ASSERT_TRUE(kept.first) << kept.second;
  EXPECT_EQ(kept.second, by_config.second);
  for (const char* budget : {"0.25", "40"}) {
    const auto compressed = generate("7", {"--kv.policy", "snapkv", "--kv.budget", budget, "--kv.option", "window=8"});
    ASSERT_TRUE(compressed.first) << compressed.second;
    EXPECT_EQ(compressed.second.rfind("Document 7: the", 0), 0u) << compressed.second;
  }
  struct Usage {
    std::vector<std::string> args;
    std::string message;
  };
  for (const Usage& u : std::vector<Usage>{{{"--kv.policy", "lru"}, "unknown policy 'lru'"},
                                           {{"--kv.policy", "window", "--kv.budget", "1.5"}, "budget 1.5 must be"},
                                           {{"--kv.policy", "full", "--kv.budget", "0.5"}, "needs another policy"},
                                           {{"--kv.policy", "h2o", "--kv.option", "kernel=3"}, "h2o has no option 'kernel'"},
                                           {{"--kv.policy", "h2o", "--kv.option", "recent_fraction"}, "KEY=VALUE"},
                                           {{"--kv.policy", "window", "--kv.option", "budget=0.1"}, "set by the budget"},
                                           {{"--kv.policy", "h2o", "--kv.option", "interval=2", "--kv.option", "interval=3"},
                                            "given twice"},
                                           {{"--kv.budget", "nan"}, "--kv.budget"}}) {
    const auto r = generate("", u.args);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << u.message << ": " << r.second;
    EXPECT_NE(r.second.find(u.message), std::string::npos) << r.second;
  }
  fs::remove_all(dir);
}

TEST(CliRuns, BenchComparesPlannersOnTheSameSamples) {
  fs::path dir = make_workdir("bench");
  std::vector<std::string> args = train_args(dir, {"--train.max_steps=4"});
  args.erase(args.begin());  // "train": the bench runs it
  args.erase(std::remove_if(args.begin(), args.end(),
                            [](const std::string& a) {  // keys the bench sets itself
                              return a.rfind("--run.dir=", 0) == 0 || a.rfind("--train.planner=", 0) == 0;
                            }),
             args.end());
  std::vector<std::string> bench = {DCP_BINARY, "bench", "--nproc", "2", "--planners", "bucket,dcp-opt", "--slices",
                                    "2", "--grace", "3", "--out", (dir / "bench").string()};
  bench.insert(bench.end(), args.begin(), args.end());
  Child c = Child::spawn(bench, {}, (dir / "bench.log").string());
  ASSERT_TRUE(exited_ok(c.wait(240))) << c.log();
  for (const char* f : {"bench.md", "bench.csv", "bench.png", "bucket/metrics.jsonl", "dcp-opt/bench_slice2.log"}) {
    EXPECT_TRUE(fs::exists(dir / "bench" / f)) << f;
  }
  std::ifstream csv(dir / "bench" / "bench.csv");
  std::map<std::string, std::vector<std::string>> rows;
  for (std::string line; std::getline(csv, line);) {
    std::vector<std::string> fields;
    std::stringstream ss(line);
    for (std::string f; std::getline(ss, f, ',');) fields.push_back(f);
    rows[fields.at(0)] = fields;
  }
  ASSERT_TRUE(rows.count("bucket") && rows.count("dcp-opt")) << c.log();
  for (const char* p : {"bucket", "dcp-opt"}) {
    EXPECT_EQ(rows[p].at(1), "4") << p;  // steps
    EXPECT_EQ(rows[p].at(2), "2") << p;  // steps measured: the first step of each of the 2 slices is a warm-up
    // both slices of a planner continue one run: 4 lines of metrics, one per step
    EXPECT_EQ(count_lines(dir / "bench" / p / "metrics.jsonl"), 4) << p;
  }
  EXPECT_EQ(rows["bucket"].at(5), "1.0000");  // speedup of bucket over itself
  std::ifstream md_in(dir / "bench" / "bench.md");
  std::string md((std::istreambuf_iterator<char>(md_in)), std::istreambuf_iterator<char>());
  EXPECT_NE(md.find("| bucket | 4 (2) |"), std::string::npos) << md;
  EXPECT_NE(md.find("| dcp-opt | 4 (2) |"), std::string::npos) << md;
  EXPECT_NE(md.find("bench --nproc 2 --planners bucket,dcp-opt"), std::string::npos) << md;
  fs::remove_all(dir);
}

TEST(CliRuns, BenchRejectsBadInputsBeforeTraining) {
  fs::path dir = make_workdir("bench_bad");
  struct Case {
    std::vector<std::string> args;
    std::string expected;
  };
  std::ofstream(dir / "a_file") << "x";
  std::vector<Case> cases = {
      {{"--planners", "bucket,no-such-planner"}, "unknown planner 'no-such-planner'"},
      {{"--planners", "static,"}, "--planners 'static,': an empty entry"},
      {{"--planners", "static,,bucket"}, "--planners 'static,,bucket': an empty entry"},
      {{"--train.planner=packed"}, "train.planner"},
      {{"--model.n_layers=-2"}, "model.n_layers"},
      {{"--memory.budget_bytes=0x10"}, "'memory.budget_bytes': bad value '0x10'"},
      {{"--out", (dir / "a_file").string()}, "--out '" + (dir / "a_file").string() + "': '" +
                                                 (dir / "a_file").string() + "' is not a folder"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> args = {DCP_BINARY, "bench", "--no-plot"};
    if (c.args[0] != "--out") args.insert(args.end(), {"--out", (dir / "bench").string()});
    args.insert(args.end(), c.args.begin(), c.args.end());
    Child ch = Child::spawn(args, {}, (dir / "bad.log").string());
    int status = ch.wait(60);
    EXPECT_TRUE(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 2) << c.expected << "\n" << ch.log();
    EXPECT_NE(ch.log().find(c.expected), std::string::npos) << ch.log();
  }
  EXPECT_FALSE(fs::exists(dir / "bench" / "bucket")) << "no run may start on bad input";
  fs::remove_all(dir);
}

TEST(CliRuns, DistillOnTwoRanksWritesAStudentThatTrainResumes) {
  fs::path dir = make_workdir("distill");
  Child t = Child::spawn([&] {
    auto a = train_args(dir, {"--train.max_steps=3"});
    a.insert(a.begin(), DCP_BINARY);
    return a;
  }(), {}, (dir / "teacher.log").string());
  ASSERT_TRUE(exited_ok(t.wait(120))) << t.log();
  const std::string teacher = (dir / "run" / "checkpoint").string(), out = (dir / "student").string();
  Child d = Child::spawn(launch(2, {DCP_BINARY, "distill", "--teacher", teacher, "--out", out, "--fit-steps", "4",
                                    "--fit-batch-tokens", "512", "--finetune-steps", "2", "--train.threads=1",
                                    "--attention.num_features=8"}),
                         {}, (dir / "distill.log").string());
  ASSERT_TRUE(exited_ok(d.wait(240))) << d.log();
  const auto j = nlohmann::json::parse(std::ifstream(fs::path(out) / "distill.json"));
  for (const char* k : {"teacher", "student_initial", "student_fitted", "student_finetuned"}) {
    EXPECT_GT(j.at("heldout_bits_per_byte").at(k).get<double>(), 0.0) << k;
  }
  EXPECT_EQ(j.at("world_size"), 2);
  EXPECT_EQ(j.at("layers").size(), 2u);
  EXPECT_EQ(count_lines(fs::path(out) / "metrics.jsonl"), 2);
  EXPECT_NE(d.log().find("| student after fine-tuning (2 steps) |"), std::string::npos) << d.log();

  // The student is an ordinary run: `dcp train --resume` goes on from step 2 with the flexformer config.
  Child r = Child::spawn({DCP_BINARY, "train", "--config", out + "/config.yaml", "--resume", "--train.max_steps=3"},
                         {}, (dir / "resume.log").string());
  ASSERT_TRUE(exited_ok(r.wait(120))) << r.log();
  EXPECT_EQ(count_lines(fs::path(out) / "metrics.jsonl"), 3);
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(fs::path(out) / "summary.json")).at("steps"), 3);

  struct Case {
    std::vector<std::string> args;
    int code;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{"--teacher", (dir / "missing").string(), "--out", (dir / "o1").string()}, 2, "missing"},
      {{"--teacher", teacher, "--out", out}, 2, "is not empty"},
      {{"--teacher", teacher, "--out", (dir / "o2").string(), "--fit-steps", "-3"}, 2, "--fit-steps"},
      {{"--teacher", teacher, "--out", (dir / "o3").string(), "--train.max_steps=5"}, 2, "--finetune-steps"},
      {{"--teacher", out + "/checkpoint", "--out", (dir / "o4").string()}, 2, "needs a softmax teacher"},
      {{"--teacher", (dir / "run").string(), "--out", (dir / "o5").string()}, 2,
       "did you mean '" + teacher + "'?"},
      {{"--teacher", teacher, "--out", (dir / "o6").string(), "--fit-lr", "nan"}, 2,
       "--fit-lr: must be a positive finite number, got 'nan'"},
      {{"--teacher", teacher, "--out", (dir / "o6").string(), "--fit-batch-tokens", "100000000"}, 2,
       "--fit-batch-tokens"},
      {{"--teacher", teacher, "--out", (dir / "o6").string(), "--attention.backend=softmax"}, 2,
       "must be flexformer"},
      {{"--teacher", teacher, "--out", (dir / "o6").string(), "--model.d_model=64"}, 2, "teacher's model shape"},
      {{"--teacher", teacher, "--out", "/proc/x"}, 2, "--out '/proc/x': cannot create the folder"},
      // A failed start writes nothing to --out, so the same command may run again without --force.
      {{"--teacher", teacher, "--out", (dir / "o7").string(), "--data.path=/nonexistent"}, 1, "/nonexistent"},
      {{"--teacher", teacher, "--out", (dir / "o7").string(), "--data.path=/nonexistent"}, 1, "/nonexistent"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> args = {DCP_BINARY, "distill"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    Child ch = Child::spawn(args, {}, (dir / "bad.log").string());
    const int status = ch.wait(60);
    EXPECT_TRUE(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == c.code) << c.expected << "\n" << ch.log();
    EXPECT_NE(ch.log().find(c.expected), std::string::npos) << ch.log();
  }
  fs::remove_all(dir);
}
