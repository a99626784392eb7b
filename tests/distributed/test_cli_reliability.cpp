// The reliability probe's defects (../shared/notes/reliability-2026-12.md, R1-R12, R15, R20) against the dcp
// binary: corrupt or hand-edited checkpoints, write errors, crash windows, a shared run dir, broken metrics,
// appended logs, a changed corpus, what may change on resume.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "distributed/cli_run.h"
#include "distributed/process.h"
#include "unit/checkpoint_edit.h"

namespace fs = std::filesystem;
using dcp::test::Child;
using dcp::test::exited_ok;
using namespace dcp::test::cli;
using nlohmann::json;
using dcp::test::read_file;
using dcp::test::replace_with_manifest;
using dcp::test::flip_byte_in_zip_entry;
using dcp::test::write_file;

namespace {


struct Outcome {
  int status = -1;
  std::string log;
  int code() const { return status >= 0 && WIFEXITED(status) ? WEXITSTATUS(status) : -1; }
};

Outcome run(const fs::path& dir, std::vector<std::string> args, const std::string& log_name, double timeout_s = 240) {
  if (args.empty() || args[0] != "/bin/bash") args.insert(args.begin(), DCP_BINARY);
  Child c = Child::spawn(args, {}, (dir / log_name).string());
  Outcome r;
  r.status = c.wait(timeout_s);
  r.log = c.log();
  return r;
}

// A scratch folder with a step-4 checkpoint of an 8-step run in `pristine/`; each case copies it.
struct Workdir {
  fs::path dir;
  explicit Workdir(const std::string& name) : dir(make_workdir(name)) {
    const Outcome r = run(dir, train_args(dir, {"--train.max_steps=8", "--train.stop_after_steps=4",
                                            "--run.dir=" + (dir / "pristine").string()}),
                      "pristine.log");
    EXPECT_TRUE(exited_ok(r.status)) << r.log;
  }
  ~Workdir() { fs::remove_all(dir); }
  fs::path copy(const std::string& name) const {
    fs::copy(dir / "pristine", dir / name, fs::copy_options::recursive);
    return dir / name;
  }
  std::vector<std::string> resume(const fs::path& run_dir, std::vector<std::string> extra = {}) const {
    extra.insert(extra.begin(), {"--train.max_steps=8", "--resume", "--run.dir=" + run_dir.string()});
    return train_args(dir, extra);
  }
};

std::vector<int64_t> steps(const fs::path& metrics) {
  std::vector<int64_t> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) out.push_back(json::parse(line).at("step"));
  return out;
}

}  // namespace

// R2, R4, R15: train --resume, generate and distill refuse a corrupt checkpoint naming the file (exit 1).
TEST(CliReliability, CorruptOrHandEditedCheckpointsAreRefused) {
  const Workdir w("corrupt");
  const fs::path flip = w.copy("flip");
  std::string model = read_file(flip / "checkpoint" / "model.pt");
  model[model.size() / 2] = static_cast<char>(model[model.size() / 2] ^ 0xFF);
  write_file(flip / "checkpoint" / "model.pt", model);
  const std::string named = "checkpoint file '" + (flip / "checkpoint" / "model.pt").string() + "' is corrupt";
  Outcome r = run(w.dir, w.resume(flip), "flip_resume.log");
  EXPECT_EQ(r.code(), 1) << r.log;
  EXPECT_NE(r.log.find(named), std::string::npos) << r.log;
  r = run(w.dir, {"generate", "--checkpoint", (flip / "checkpoint").string(), "--prompt", "x"}, "flip_gen.log");
  EXPECT_EQ(r.code(), 1) << r.log;
  EXPECT_NE(r.log.find(named), std::string::npos) << r.log;
  r = run(w.dir,
          {"distill", "--teacher", (flip / "checkpoint").string(), "--out", (w.dir / "student").string(),
           "--data.path=" + (w.dir / "corpus.jsonl").string(), "--attention.backend=flexformer"},
          "flip_distill.log");
  EXPECT_EQ(r.code(), 1) << r.log;
  EXPECT_NE(r.log.find(named), std::string::npos) << r.log;

  const fs::path edited = w.copy("edited");
  json state = json::parse(read_file(edited / "checkpoint" / "state.json"));
  state["index_in_epoch"] = -5;  // the probe's segmentation fault
  replace_with_manifest(edited / "checkpoint", "state.json", state.dump());
  r = run(w.dir, w.resume(edited), "edited.log");
  EXPECT_EQ(r.code(), 1) << r.log;
  EXPECT_NE(r.log.find("state.json': field 'index_in_epoch' is -5, out of range"), std::string::npos) << r.log;

  // The optimizer state of another model shape (d_ff 96), with its manifest entry fixed.
  const Outcome other = run(w.dir, train_args(w.dir, {"--model.d_ff=96", "--train.max_steps=2",
                                                  "--run.dir=" + (w.dir / "wide").string()}),
                        "wide.log");
  ASSERT_TRUE(exited_ok(other.status)) << other.log;
  const fs::path swapped = w.copy("swapped");
  replace_with_manifest(swapped / "checkpoint", "optimizer.pt", read_file(w.dir / "wide" / "checkpoint" / "optimizer.pt"));
  r = run(w.dir, w.resume(swapped), "swapped.log");
  EXPECT_EQ(r.code(), 1) << r.log;
  EXPECT_NE(r.log.find("optimizer.pt' does not fit the model: AdamW exp_avg of parameter"), std::string::npos)
      << r.log;
}

// R1, R6: a write error during a checkpoint (RLIMIT_FSIZE: EFBIG; and a full tmpfs, ENOSPC, where this test may
// mount one) ends the run with exit 1 and one line naming the file, and the previous checkpoint resumes.
TEST(CliReliability, AFailedCheckpointWriteExitsOneAndKeepsThePreviousCheckpoint) {
  const Workdir w("full");
  const fs::path big = w.copy("fsize");
  std::string cmd = "trap '' XFSZ; ulimit -f 64; exec";  // 64 KiB: the logs and metrics fit, model.pt does not
  for (const auto& a : w.resume(big, {"--train.checkpoint_every=1", "--train.stop_after_steps=1"})) cmd += " '" + a + "'";
  cmd.insert(cmd.find("exec") + 4, std::string(" ") + DCP_BINARY);
  Outcome r = run(w.dir, {"/bin/bash", "-c", cmd}, "fsize.log");
  EXPECT_EQ(r.code(), 1) << r.log;
  EXPECT_NE(r.log.find("writing checkpoint '" + (big / "checkpoint").string() + "' failed: cannot write"),
            std::string::npos)
      << r.log;
  EXPECT_NE(r.log.find("File too large"), std::string::npos) << r.log;
  EXPECT_EQ(r.log.find("terminate called"), std::string::npos) << r.log;
  r = run(w.dir, w.resume(big), "fsize_resume.log");
  ASSERT_TRUE(exited_ok(r.status)) << r.log;
  EXPECT_NE(r.log.find("resumed from " + (big / "checkpoint").string() + " at step 4"), std::string::npos) << r.log;
  EXPECT_EQ(steps(big / "metrics.jsonl"), (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8}));

  // ENOSPC on a real full file system, in a private mount namespace (needs root; skipped otherwise).
  const Outcome probe = run(w.dir, {"/bin/bash", "-c", "unshare -m true"}, "unshare.log", 30);
  if (!exited_ok(probe.status)) GTEST_SKIP() << "cannot create a mount namespace for the ENOSPC case: " << probe.log;
  const fs::path mnt = w.dir / "small";
  fs::create_directories(mnt);
  std::string inner = "mount -t tmpfs -o size=1m tmpfs '" + mnt.string() + "' && cp -r '" + (w.dir / "pristine").string() +
                      "' '" + (mnt / "run").string() + "' && head -c 1000000 /dev/zero > '" + (mnt / "filler").string() +
                      "' 2>/dev/null; exec " + DCP_BINARY;
  for (const auto& a : w.resume(mnt / "run", {"--train.checkpoint_every=1", "--train.stop_after_steps=1"})) inner += " '" + a + "'";
  r = run(w.dir, {"/bin/bash", "-c", "unshare -m bash -c \"$0\"", inner}, "enospc.log");
  EXPECT_EQ(r.code(), 1) << r.log;
  EXPECT_NE(r.log.find("No space left on device"), std::string::npos) << r.log;
  EXPECT_EQ(r.log.find("terminate called"), std::string::npos) << r.log;
}

// R5: the state a crash between the two renames leaves (only checkpoint.old, and a complete checkpoint.tmp)
// resumes from checkpoint.old and says so; the next save installs checkpoint again.
TEST(CliReliability, ACrashBetweenTheRenamesResumesFromTheOldCheckpoint) {
  const Workdir w("renames");
  const fs::path d = w.copy("crashed");
  fs::rename(d / "checkpoint", d / "checkpoint.old");
  fs::copy(d / "checkpoint.old", d / "checkpoint.tmp");
  const Outcome r = run(w.dir, w.resume(d, {"--train.checkpoint_every=1", "--train.stop_after_steps=1"}), "crashed.log");
  ASSERT_TRUE(exited_ok(r.status)) << r.log;
  EXPECT_NE(r.log.find("is missing (a crash between the renames of a save); loading the previous checkpoint '" +
                       (d / "checkpoint.old").string() + "' (step 4) instead"),
            std::string::npos)
      << r.log;
  EXPECT_NE(r.log.find("resumed from " + (d / "checkpoint.old").string() + " at step 4"), std::string::npos) << r.log;
  EXPECT_EQ(json::parse(read_file(d / "checkpoint" / "state.json")).at("step"), 5);
  EXPECT_EQ(json::parse(read_file(d / "checkpoint.old" / "state.json")).at("step"), 4);  // the previous one stays
  EXPECT_FALSE(fs::exists(d / "checkpoint.tmp"));
}

// The review's open items on checkpoints, against the binary: a flipped byte in model.pt or optimizer.pt behind a
// manifest rewritten to match is refused (the zip entries' own CRC32s); a step of 1e18 is out of range; an
// upper-case crc32 reads; the warning about a checkpoint without manifest is printed once.
TEST(CliReliability, ForgedManifestsAndEditedNumbersAreRefused) {
  const Workdir w("forged");
  for (const char* file : {"model.pt", "optimizer.pt"}) {
    const fs::path d = w.copy(std::string("forged_") + file);
    replace_with_manifest(d / "checkpoint", file,
                          dcp::test::flip_byte_in_zip_entry(read_file(d / "checkpoint" / file), "/data/"));
    const Outcome r = run(w.dir, w.resume(d), std::string("forged_") + file + ".log");
    EXPECT_EQ(r.code(), 1) << r.log;
    EXPECT_NE(r.log.find("checkpoint file '" + (d / "checkpoint" / file).string() + "' is corrupt: zip entry '"),
              std::string::npos)
        << r.log;
  }
  const fs::path big = w.copy("step_1e18");
  json state = json::parse(read_file(big / "checkpoint" / "state.json"));
  state["step"] = 1e18;
  replace_with_manifest(big / "checkpoint", "state.json", state.dump());
  Outcome r = run(w.dir, w.resume(big), "step_1e18.log");
  EXPECT_EQ(r.code(), 1) << r.log;
  EXPECT_NE(r.log.find("field 'step' is 1e+18, out of range"), std::string::npos) << r.log;

  const fs::path upper = w.copy("upper");
  json m = json::parse(read_file(upper / "checkpoint" / "manifest.json"));
  for (auto& [name, f] : m["files"].items()) {
    std::string crc = f["crc32"];
    for (char& c : crc) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    f["crc32"] = crc;
  }
  write_file(upper / "checkpoint" / "manifest.json", m.dump());
  r = run(w.dir, w.resume(upper), "upper.log");
  EXPECT_TRUE(exited_ok(r.status)) << r.log;

  const fs::path legacy = w.copy("legacy");
  fs::remove(legacy / "checkpoint" / "manifest.json");
  r = run(w.dir, w.resume(legacy), "legacy.log");
  EXPECT_TRUE(exited_ok(r.status)) << r.log;
  size_t warnings = 0;
  for (size_t at = r.log.find("has no manifest.json"); at != std::string::npos; at = r.log.find("has no manifest.json", at + 1)) {
    ++warnings;
  }
  EXPECT_EQ(warnings, 1u) << r.log;
}

// A corrupt newest checkpoint: generate and train --resume fall back to checkpoint.old and say so; the resumed
// run's next save removes the refused one, so that the good one stays the previous checkpoint; the final
// checkpoint is written once when the last periodic save was of the same step.
TEST(CliReliability, ACorruptNewestCheckpointFallsBackToThePreviousOne) {
  const Workdir w("fallback");
  const fs::path d = w.copy("two");
  // Steps 5 and 6, a save after each (checkpoint_every 1): checkpoint is step 6, checkpoint.old step 5; step 6 is
  // saved by the periodic save and must not be written again by the final one.
  Outcome r = run(w.dir, w.resume(d, {"--train.checkpoint_every=1", "--train.stop_after_steps=2"}), "two.log");
  ASSERT_TRUE(exited_ok(r.status)) << r.log;
  const std::string ckpt = (d / "checkpoint").string();
  size_t writes = 0;
  for (size_t at = r.log.find("wrote checkpoint " + ckpt + " (step 6)"); at != std::string::npos;
       at = r.log.find("wrote checkpoint " + ckpt + " (step 6)", at + 1)) {
    ++writes;
  }
  EXPECT_EQ(writes, 1u) << r.log;
  EXPECT_EQ(json::parse(read_file(d / "checkpoint.old" / "state.json")).at("step"), 5);

  std::string model = read_file(d / "checkpoint" / "model.pt");
  model[model.size() / 2] = static_cast<char>(model[model.size() / 2] ^ 0xFF);
  write_file(d / "checkpoint" / "model.pt", model);
  const std::string fallback = "checkpoint '" + ckpt + "' is refused (checkpoint file '" + ckpt +
                               "/model.pt' is corrupt";
  r = run(w.dir, {"generate", "--checkpoint", ckpt, "--prompt", "x", "--max-new-tokens", "4"}, "generate.log");
  EXPECT_TRUE(exited_ok(r.status)) << r.log;
  EXPECT_NE(r.log.find(fallback), std::string::npos) << r.log;
  EXPECT_NE(r.log.find("loading the previous checkpoint '" + ckpt + ".old' (step 5) instead"), std::string::npos)
      << r.log;
  r = run(w.dir, w.resume(d, {"--train.checkpoint_every=1", "--train.stop_after_steps=1"}), "resume_old.log");
  ASSERT_TRUE(exited_ok(r.status)) << r.log;
  EXPECT_NE(r.log.find(fallback), std::string::npos) << r.log;
  EXPECT_NE(r.log.find("resumed from " + ckpt + ".old at step 5"), std::string::npos) << r.log;
  EXPECT_NE(r.log.find("removing the refused checkpoint " + ckpt), std::string::npos) << r.log;
  EXPECT_EQ(json::parse(read_file(d / "checkpoint" / "state.json")).at("step"), 6);
  EXPECT_EQ(json::parse(read_file(d / "checkpoint.old" / "state.json")).at("step"), 5);
  EXPECT_EQ(steps(d / "metrics.jsonl"), (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
}

// A missing or shortened metrics.jsonl on resume is named; a metrics.jsonl.<pid>.tmp left by a kill is removed.
TEST(CliReliability, MissingOrShortenedMetricsAreNamedAndLeftoverTempFilesRemoved) {
  const Workdir w("metrics_gaps");
  const fs::path gone = w.copy("gone");
  fs::remove(gone / "metrics.jsonl");
  std::ofstream(gone / "metrics.jsonl.4242.tmp") << "{\"step\": 1}\n";
  Outcome r = run(w.dir, w.resume(gone, {"--train.stop_after_steps=1"}), "gone.log");
  ASSERT_TRUE(exited_ok(r.status)) << r.log;
  EXPECT_NE(r.log.find("metrics '" + (gone / "metrics.jsonl").string() +
                       "' is missing: the lines of steps 1..4 (before the checkpoint) are lost"),
            std::string::npos)
      << r.log;
  EXPECT_NE(r.log.find("removed 1 temporary file(s) left in " + gone.string() + " by an interrupted run: "
                       "metrics.jsonl.4242.tmp"),
            std::string::npos)
      << r.log;
  EXPECT_FALSE(fs::exists(gone / "metrics.jsonl.4242.tmp"));
  EXPECT_EQ(steps(gone / "metrics.jsonl"), (std::vector<int64_t>{5}));

  const fs::path short_file = w.copy("short");
  std::string metrics = read_file(short_file / "metrics.jsonl");
  size_t cut = 0;
  for (int i = 0; i < 2; ++i) cut = metrics.find('\n', cut) + 1;
  write_file(short_file / "metrics.jsonl", metrics.substr(0, cut));  // steps 1 and 2 of 4
  r = run(w.dir, w.resume(short_file, {"--train.stop_after_steps=1"}), "short.log");
  ASSERT_TRUE(exited_ok(r.status)) << r.log;
  EXPECT_NE(r.log.find("lacks the lines of 2 step(s) before the checkpoint's step 4: 3..4"), std::string::npos)
      << r.log;
  EXPECT_EQ(steps(short_file / "metrics.jsonl"), (std::vector<int64_t>{1, 2, 5}));
}

// A rendezvous port in use is said at once (rank 0 cannot serve the store), not after dist.timeout_s.
TEST(CliReliability, ARendezvousPortInUseIsNamedAtOnce) {
  const fs::path dir = make_workdir("port_in_use");
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof(a);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(fd, 4), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const int port = ntohs(a.sin_port);
  auto args = launch(2, train_args(dir, {"--train.max_steps=2", "--dist.timeout_s=30"}));
  args.insert(args.begin() + 2, {"--master-port", std::to_string(port)});
  const auto start = std::chrono::steady_clock::now();
  Child c = Child::spawn(args, {{"OMP_NUM_THREADS", "1"}}, (dir / "port.log").string());
  const int status = c.wait(60);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  close(fd);
  EXPECT_TRUE(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 1) << c.log();
  EXPECT_NE(c.log().find("rank 0 cannot serve the store: port " + std::to_string(port) + " is in use"),
            std::string::npos)
      << c.log();
  EXPECT_LT(took, 20.0) << "not at once: dist.timeout_s is 30";
  fs::remove_all(dir);
}

// R7: a second run on a run dir in use is refused naming the holder; the lock dies with its holder (kill -9).
TEST(CliReliability, ASecondRunOnTheSameRunDirIsRefused) {
  const Workdir w("lock");
  const fs::path d = w.dir / "busy";
  auto args = train_args(w.dir, {"--train.max_steps=100000", "--train.checkpoint_every=0", "--run.dir=" + d.string()});
  args.insert(args.begin(), DCP_BINARY);
  Child first = Child::spawn(args, {}, (w.dir / "first.log").string());
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (count_lines(d / "metrics.jsonl") < 1 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_GE(count_lines(d / "metrics.jsonl"), 1) << first.log();
  const Outcome second = run(w.dir, train_args(w.dir, {"--train.max_steps=2", "--run.dir=" + d.string()}), "second.log", 60);
  EXPECT_EQ(second.code(), 1) << second.log;
  EXPECT_NE(second.log.find("run.dir '" + d.string() + "' is in use by another dcp run (pid " +
                            std::to_string(first.pid) + " on host"),
            std::string::npos)
      << second.log;
  EXPECT_NE(first.pid, -1);
  int status = 0;
  EXPECT_EQ(waitpid(first.pid, &status, WNOHANG), 0) << "the first run stopped";
  first.kill_now();
  const Outcome third = run(w.dir, train_args(w.dir, {"--train.max_steps=2", "--run.dir=" + d.string()}), "third.log");
  EXPECT_TRUE(exited_ok(third.status)) << third.log;
}

// R8, R9: a partial last metrics line is dropped with a warning; logs are appended to, with a header line per
// invocation, also by a refused resume.
TEST(CliReliability, ResumeDropsAPartialMetricsLineAndLogsAreAppended) {
  const Workdir w("metrics");
  const fs::path d = w.copy("partial");
  std::ofstream(d / "metrics.jsonl", std::ios::app) << "{\"step\": 5, \"lo";
  std::ofstream(d / "logs" / "rank0.log", std::ios::app) << "[marker] the previous invocation's error\n";
  Outcome r = run(w.dir, w.resume(d, {"--model.d_model=64"}), "refused.log");
  EXPECT_EQ(r.code(), 1) << r.log;
  r = run(w.dir, w.resume(d), "partial.log");
  ASSERT_TRUE(exited_ok(r.status)) << r.log;
  EXPECT_NE(r.log.find("dropped its partial last line 5"), std::string::npos) << r.log;
  EXPECT_EQ(steps(d / "metrics.jsonl"), (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8}));
  const std::string log = read_file(d / "logs" / "rank0.log");
  EXPECT_NE(log.find("[marker] the previous invocation's error"), std::string::npos);
  EXPECT_NE(log.find("==== dcp train begins: pid"), std::string::npos);
  EXPECT_NE(log.find("==== dcp train --resume begins: pid"), std::string::npos);

  // A bad line before the last one is not a crash's: refused naming the file and the line.
  const fs::path bad = w.copy("bad_line");
  std::string metrics = read_file(bad / "metrics.jsonl");
  metrics.insert(metrics.find('\n') + 1, "not json\n");
  write_file(bad / "metrics.jsonl", metrics);
  r = run(w.dir, w.resume(bad), "bad_line.log");
  EXPECT_EQ(r.code(), 1) << r.log;
  EXPECT_NE(r.log.find("metrics.jsonl' line 2 is not JSON"), std::string::npos) << r.log;
}

// R12, R20: a corpus that changed under the same data.path is refused unless --allow-data-change;
// model.recompute_layers may change on resume.
TEST(CliReliability, AChangedCorpusIsRefusedAndRecomputeMayChange) {
  const Workdir w("corpus");
  const fs::path same = w.copy("recompute");
  Outcome r = run(w.dir, w.resume(same, {"--model.recompute_layers=1"}), "recompute.log");
  EXPECT_TRUE(exited_ok(r.status)) << r.log;

  const fs::path d = w.copy("changed");
  std::ofstream(w.dir / "corpus.jsonl", std::ios::app) << json({{"text", "A document added after the checkpoint."}}).dump()
                                                       << "\n";
  r = run(w.dir, w.resume(d), "changed.log");
  EXPECT_EQ(r.code(), 1) << r.log;
  EXPECT_NE(r.log.find("the corpus under data.path '" + (w.dir / "corpus.jsonl").string() + "' changed"),
            std::string::npos)
      << r.log;
  EXPECT_NE(r.log.find("--allow-data-change"), std::string::npos) << r.log;
  r = run(w.dir, w.resume(d, {"--allow-data-change"}), "allowed.log");
  EXPECT_TRUE(exited_ok(r.status)) << r.log;
  EXPECT_NE(r.log.find("resuming anyway (--allow-data-change)"), std::string::npos) << r.log;
}

// Ranks started with different configs (here train.lr on rank 1) are refused by every rank before training.
TEST(CliReliability, RanksWithDifferentConfigsAreRefused) {
  const fs::path dir = make_workdir("config_mismatch");
  std::vector<Child> ranks;
  const int port = 20000 + static_cast<int>(getpid() % 20000);
  for (int r = 0; r < 2; ++r) {
    auto args = train_args(dir, {"--train.max_steps=2", r == 1 ? "--train.lr=0.001" : "--train.lr=0.002"});
    args.insert(args.begin(), DCP_BINARY);
    ranks.push_back(Child::spawn(args,
                                 {{"RANK", std::to_string(r)}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", std::to_string(r)},
                                  {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                                  {"MASTER_PORT", std::to_string(port)}},
                                 (dir / ("r" + std::to_string(r) + ".log")).string()));
  }
  for (auto& c : ranks) {
    const int status = c.wait(120);
    EXPECT_TRUE(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 1) << c.log();
    EXPECT_NE(c.log().find("config differs from a peer's"), std::string::npos) << c.log();
  }
  fs::remove_all(dir);
}
