// `dcp kv-eval` as a user runs it: a tiny random softmax checkpoint with peaked attention, a tiny corpus, two
// policies at two budgets in --json and --out, and usage errors (exit 2 naming the value; exit 1 for a
// checkpoint that cannot be read).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <sstream>
#include <tuple>

#include "distributed/process.h"
#include "dcp/config.h"
#include "dcp/model.h"
#include "dcp/checkpoint.h"
#include "runtime/optimizer.h"

namespace fs = std::filesystem;
using dcp::test::Child;
using dcp::test::exited_ok;

namespace {

fs::path make_workdir(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / ("dcp_kv_eval_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

std::string read(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Six documents of 300 random lowercase letters and one of 50 (too short for context 128 + continuation 32).
fs::path write_corpus(const fs::path& dir) {
  const fs::path corpus = dir / "corpus";
  fs::create_directories(corpus);
  std::mt19937 rng(5);
  for (int i = 0; i < 7; ++i) {
    std::string text;
    for (int j = 0; j < (i == 6 ? 50 : 300); ++j) text += static_cast<char>('a' + rng() % 26);
    std::ofstream(corpus / ("doc" + std::to_string(i) + ".txt")) << text;
  }
  return corpus;
}

// A checkpoint of a random 2-layer model (q and k rows of wqkv scaled by 8: peaked attention, so evicting entries
// visibly changes the output), as the trainer writes one.
fs::path write_checkpoint(const fs::path& dir, const fs::path& corpus, const std::string& backend) {
  dcp::Config cfg;
  cfg.model.d_model = 64;
  cfg.model.n_layers = 2;
  cfg.model.n_heads = 4;
  cfg.model.d_ff = 128;
  cfg.attention.backend = backend;
  cfg.train.precision = "fp32";
  cfg.train.threads = 1;
  cfg.data.path = corpus.string();
  cfg.data.format = "text_dir";
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
  const fs::path ckpt = dir / ("checkpoint_" + backend);
  dcp::save_checkpoint(ckpt.string(), model, *optimizer, dcp::TrainState{}, cfg);
  return ckpt;
}

struct Setup {
  fs::path dir, corpus, checkpoint;
};

const Setup& setup() {
  static const Setup s = [] {
    Setup r;
    r.dir = make_workdir("cli");
    r.corpus = write_corpus(r.dir);
    r.checkpoint = write_checkpoint(r.dir, r.corpus, "softmax");
    return r;
  }();
  return s;
}

std::vector<std::string> base_args() {
  const Setup& s = setup();
  return {DCP_BINARY, "kv-eval", "--checkpoint", s.checkpoint.string(), "--data.path", s.corpus.string(), "--seed",
          "1"};
}

// Runs dcp with `extra` after base_args; returns the exit code (-1 on a signal or time-out) and the log.
std::pair<int, std::string> run(const std::vector<std::string>& extra, const std::string& name) {
  auto args = base_args();
  args.insert(args.end(), extra.begin(), extra.end());
  Child c = Child::spawn(args, {{"OMP_NUM_THREADS", "1"}}, (setup().dir / (name + ".log")).string());
  const int status = c.wait(120);
  return {status >= 0 && WIFEXITED(status) ? WEXITSTATUS(status) : -1, c.log()};
}

}  // namespace

TEST(CliKvEval, JsonHasEveryFieldFullIsExactAndWindowLosesOnPeakedAttention) {
  const fs::path out = setup().dir / "report" / "kv";
  const auto [code, log] = run({"--context", "128", "--continuation", "32", "--policies", "full,window", "--budgets",
                                "0.1,0.5", "--json", "--out", out.string()},
                               "json");
  ASSERT_EQ(code, 0) << log;
  // Progress lines go to stderr first; the JSON object is what starts with '{' on its own line.
  const size_t start = log.find("\n{");
  ASSERT_NE(start, std::string::npos) << log;
  const size_t end = log.rfind('}');
  const nlohmann::json j = nlohmann::json::parse(log.substr(start + 1, end - start));
  EXPECT_EQ(j["split"], "all");
  EXPECT_EQ(j["context"], 128);
  EXPECT_EQ(j["continuation"], 32);
  EXPECT_EQ(j["chunk_tokens"], 32);  // the checkpoint's kv.chunk_tokens
  EXPECT_EQ(j["documents"]["available"], 7);
  EXPECT_EQ(j["documents"]["too_short"], 1);
  EXPECT_EQ(j["documents"]["evaluated"], 6);
  EXPECT_EQ(j["documents"]["required_tokens"], 161);
  EXPECT_EQ(j["head_ablation"].size(), 0u);  // --head-ablation not given
  ASSERT_EQ(j["results"].size(), 4u);
  for (const auto& r : j["results"]) {
    for (const char* key : {"policy", "budget", "documents", "bpb", "bpb_full", "rel_bpb_increase",
                            "rel_bpb_increase_ci", "worst_decile_rel_increase", "worst_decile_rel_increase_ci",
                            "attn_rel_err", "attn_rel_err_ci", "attn_rel_err_per_layer", "kv_bytes",
                            "kv_bytes_full", "prefill_s", "decode_s", "abstained_heads", "abstained_by_head",
                            "kv_bytes_mean", "kv_bytes_max", "kv_bytes_full_mean", "worst_decile_mean",
                            "rel_bpb_increase_per_document"}) {
      ASSERT_TRUE(r.contains(key)) << key << " in " << r.dump();
    }
    EXPECT_EQ(r["documents"], 6);
    EXPECT_EQ(r["attn_rel_err_per_layer"].size(), 2u);
    EXPECT_GT(r["bpb_full"].get<double>(), 1.0);
    if (r["policy"] == "full") {
      EXPECT_NEAR(r["rel_bpb_increase"].get<double>(), 0, 1e-12) << r.dump();
      EXPECT_NEAR(r["attn_rel_err"].get<double>(), 0, 1e-12);
      EXPECT_EQ(r["kv_bytes"], r["kv_bytes_full"]);
    }
  }
  const auto& w10 = j["results"][2];
  ASSERT_EQ(w10["policy"], "window");
  ASSERT_EQ(w10["budget"], 0.1);
  // 16 of 160 entries kept per head: attention moves a lot, and so does the loss of the worst document.
  EXPECT_GT(w10["attn_rel_err"].get<double>(), 0.05) << w10.dump();
  EXPECT_GT(w10["attn_rel_err"].get<double>(), j["results"][3]["attn_rel_err"].get<double>());
  EXPECT_GT(w10["worst_decile_rel_increase"].get<double>(), 0) << w10.dump();
  EXPECT_NE(w10["rel_bpb_increase"].get<double>(), 0);
  // Every policy compresses every 64 positions while decoding (one schedule, equal memory): after the prefill of
  // 128 each head holds ceil(0.1 x 128) = 13 entries, and decoding 129..160 reaches no multiple of 64, so the 32
  // decoded tokens stay. At the end 45 of 160 entries; the scored token i (0..31) read 13 + i + 1 entries against
  // the full cache's 128 + i + 1: mean 29.5 / 144.5, maximum 45 / 160.
  EXPECT_NEAR(w10["kv_bytes"].get<double>() / w10["kv_bytes_full"].get<double>(), 45.0 / 160.0, 1e-9);
  EXPECT_NEAR(w10["kv_bytes_mean"].get<double>() / w10["kv_bytes_full_mean"].get<double>(), 29.5 / 144.5, 1e-9);
  EXPECT_NEAR(w10["kv_bytes_max"].get<double>() / w10["kv_bytes_full_mean"].get<double>(), 45.0 / 144.5, 1e-9);
  EXPECT_EQ(w10["rel_bpb_increase_per_document"].size(), 6u);
  // --out: the markdown starts with the command, the CSV has a row per (policy, budget).
  const std::string md = read(out.string() + ".md");
  EXPECT_NE(md.find("kv-eval --checkpoint"), std::string::npos);
  EXPECT_NE(md.find("| window | 0.1 |"), std::string::npos);
  const std::string csv = read(out.string() + ".csv");
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 5);
  if (log.find("gnuplot not found") == std::string::npos) EXPECT_TRUE(fs::exists(out.string() + ".png")) << log;
}

TEST(CliKvEval, UsageErrorsExit2NamingTheValue) {
  // Each case is a process start (a few seconds on a loaded machine), so one per kind of check.
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--policies", "window,lru"}, "unknown policy 'lru'"},
      {{"--policies", "minimax:abstain_tail=x"}, "KV policy 'minimax:abstain_tail=x': KV policy option 'abstain_tail=x'"},
      {{"--budgets", "0.1,0"}, "--budgets: '0' is not a fraction in (0, 1]"},
      {{"--budgets", "nan"}, "--budgets: 'nan' is not a fraction"},
      {{"--context", "0"}, "--context: Value 0 not in range"},
      {{"--continuation", "0"}, "--continuation: Value 0 not in range"},
      {{"--context", "400", "--continuation", "32"}, "none of the 7 documents has the 433 tokens needed"},
      {{"--out", "/proc/kv/report"}, "--out '/proc/kv/report': cannot write"},
      {{"--max-rel-bpb", "0.01,0.01"}, "--max-rel-bpb: target 0.01 is given twice"},
      {{"--calibration", "x.json"}, "--calibration requires --max-rel-bpb"},
      {{"--out", ""}, "--out: must not be empty"},
  };
  int i = 0;
  for (const auto& [extra, message] : cases) {
    const auto [code, log] = run(extra, "usage" + std::to_string(i++));
    EXPECT_EQ(code, 2) << extra.front() << ": " << log;
    EXPECT_NE(log.find(message), std::string::npos) << "expected '" << message << "' in: " << log;
  }
}

TEST(CliKvEval, RefusesAFlexformerCheckpointAndAMissingOne) {
  const fs::path flex = write_checkpoint(setup().dir, setup().corpus, "flexformer");
  Child c = Child::spawn({DCP_BINARY, "kv-eval", "--checkpoint", flex.string()}, {},
                         (setup().dir / "flex.log").string());
  int status = c.wait(60);
  ASSERT_TRUE(status >= 0 && WIFEXITED(status)) << c.log();
  EXPECT_EQ(WEXITSTATUS(status), 2) << c.log();
  EXPECT_NE(c.log().find("attention.backend is 'flexformer'"), std::string::npos) << c.log();

  const std::string missing = (setup().dir / "no_such_checkpoint").string();
  Child m = Child::spawn({DCP_BINARY, "kv-eval", "--checkpoint", missing}, {}, (setup().dir / "missing.log").string());
  status = m.wait(60);
  ASSERT_TRUE(status >= 0 && WIFEXITED(status)) << m.log();
  EXPECT_EQ(WEXITSTATUS(status), 1) << m.log();
  EXPECT_NE(m.log().find(missing), std::string::npos) << m.log();
}

// dcp kv-calibrate writes CHECKPOINT/kv_calibration.json (two grid points, two targets), and kv-eval --max-rel-bpb
// runs an error-target row from it; a target below every calibrated one is a usage error, a missing file exit 1.
TEST(CliKvCalibrate, WritesTheCalibrationBesideTheCheckpointAndKvEvalRunsItsTarget) {
  const fs::path dir = setup().dir / "calibrate";
  fs::create_directories(dir);
  const fs::path ckpt = write_checkpoint(dir, setup().corpus, "softmax");
  auto spawn = [&](const std::vector<std::string>& args, const std::string& name) {
    Child c = Child::spawn(args, {{"OMP_NUM_THREADS", "1"}}, (dir / (name + ".log")).string());
    const int status = c.wait(240);
    return std::pair<int, std::string>{status >= 0 && WIFEXITED(status) ? WEXITSTATUS(status) : -1, c.log()};
  };
  const auto [code, log] = spawn({DCP_BINARY, "kv-calibrate", "--checkpoint", ckpt.string(), "--data.path",
                                  setup().corpus.string(), "--split", "all", "--context", "128", "--continuation",
                                  "32", "--grid", "0.5,0.02", "--targets", "1,0.01", "--coverage", "0.8"},
                                 "calibrate");
  ASSERT_EQ(code, 0) << log;
  EXPECT_NE(log.find("| max_rel_error | mean rel bpb increase |"), std::string::npos) << log;
  const fs::path file = ckpt / "kv_calibration.json";
  ASSERT_TRUE(fs::exists(file)) << log;
  const nlohmann::json cal = nlohmann::json::parse(read(file));
  EXPECT_EQ(cal["format"], "dcp-kv-calibration-1");
  EXPECT_EQ(cal["split"], "all");
  EXPECT_EQ(cal["documents"], 6);
  ASSERT_EQ(cal["grid"].size(), 2u);
  EXPECT_EQ(cal["grid"][0]["max_rel_error"], 0.02);  // sorted
  EXPECT_EQ(cal["grid"][1]["max_rel_error"], 0.5);
  for (const auto& p : cal["grid"]) {
    EXPECT_GT(p["bytes_ratio"].get<double>(), 0) << p.dump();
    EXPECT_LE(p["bytes_ratio"].get<double>(), 1.0 + 1e-9) << p.dump();
  }
  // A 25x looser bound on each block's predicted error keeps no more of the cache.
  EXPECT_LE(cal["grid"][1]["bytes_ratio"].get<double>(), cal["grid"][0]["bytes_ratio"].get<double>()) << cal.dump();
  ASSERT_EQ(cal["choices"].size(), 2u);
  EXPECT_EQ(cal["choices"][1]["max_rel_bpb"], 1.0);
  // At a 2% predicted relative error per block the bpb of the random model does not double: target 1 is met.
  const double chosen = cal["choices"][1]["max_rel_error"].get<double>();
  ASSERT_GT(chosen, 0) << cal.dump();

  const std::vector<std::string> eval = {DCP_BINARY, "kv-eval", "--checkpoint", ckpt.string(), "--data.path",
                                         setup().corpus.string(), "--context", "128", "--continuation", "32",
                                         "--policies", "full", "--budgets", "1"};
  EXPECT_EQ(cal["weights"].get<std::string>().size(), 16u) << cal.dump();
  ASSERT_FALSE(cal["sources"].empty()) << cal.dump();
  // The calibration used every document (--split all): evaluating them again is not a held-out check, refused
  // before the model loads unless asked for, and then said in the report.
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = eval;
    a.push_back("--allow-calibration-overlap");
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  {
    std::vector<std::string> a = eval;
    a.insert(a.end(), {"--max-rel-bpb", "1", "--split", "all"});
    const auto [code2, log2] = spawn(a, "eval_overlap");
    EXPECT_EQ(code2, 2) << log2;
    EXPECT_NE(log2.find("were calibration documents of '" + file.string() + "'"), std::string::npos) << log2;
    EXPECT_NE(log2.find("calibrate again with --split calibration"), std::string::npos) << log2;
  }
  const auto [ecode, elog] = spawn(with({"--max-rel-bpb", "1", "--json"}), "eval_target");
  ASSERT_EQ(ecode, 0) << elog;
  const size_t start = elog.find("\n{");
  ASSERT_NE(start, std::string::npos) << elog;
  const nlohmann::json j = nlohmann::json::parse(elog.substr(start + 1, elog.rfind('}') - start));
  ASSERT_EQ(j["results"].size(), 2u) << j.dump();
  const auto& row = j["results"][1];
  EXPECT_EQ(row["policy"], "minimax");
  EXPECT_EQ(row["max_rel_bpb"], 1.0);
  EXPECT_EQ(row["max_rel_error"].get<double>(), chosen);
  EXPECT_GE(row["within_target"].get<double>(), 0.0);
  EXPECT_LE(row["within_target"].get<double>(), 1.0);
  EXPECT_NE(j["calibration"].get<std::string>().find("kv_calibration.json"), std::string::npos);
  EXPECT_NE(j["calibration"].get<std::string>().find("**Not held out**"), std::string::npos) << j["calibration"];
  // kv-eval --max-rel-bpb 1 with the calibration file edited by `edit`, written to <dir>/<name>.json: the exit
  // code, the log and the file's path.
  auto eval_edited = [&](const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json edited = cal;
    edit(edited);
    const std::string path = (dir / (name + ".json")).string();
    std::ofstream(path) << edited.dump(2);
    const auto [c, l] = spawn(with({"--max-rel-bpb", "1", "--calibration", path}), "eval_" + name);
    return std::tuple<int, std::string, std::string>{c, l, path};
  };
  // A calibration of other weights is refused (exit 1) naming both fingerprints; one without a fingerprint or
  // sources (written before they were recorded) runs with a warning.
  const auto [wcode, wlog, wpath] =
      eval_edited("other_weights", [](nlohmann::json& c) { c["weights"] = "0123456789abcdef"; });
  EXPECT_EQ(wcode, 1) << wlog;
  EXPECT_NE(wlog.find("KV calibration '" + wpath + "'"), std::string::npos) << wlog;
  EXPECT_NE(wlog.find("was made for other weights (fingerprint 0123456789abcdef"), std::string::npos) << wlog;
  const auto [ocode2, olog2, opath] = eval_edited("old_format", [](nlohmann::json& c) {
    c.erase("weights");
    c.erase("sources");
  });
  EXPECT_EQ(ocode2, 0) << olog2;
  EXPECT_NE(olog2.find("KV calibration '" + opath + "' records no"), std::string::npos) << olog2;
  EXPECT_NE(olog2.find("records no weights fingerprint"), std::string::npos) << olog2;
  EXPECT_NE(olog2.find("records no source files"), std::string::npos) << olog2;
  // A choice no kv-calibrate grid can hold is a bad file.
  const auto [hcode, hlog, hpath] =
      eval_edited("huge", [](nlohmann::json& c) { c["choices"][0]["max_rel_error"] = 1e300; });
  EXPECT_EQ(hcode, 1) << hlog;
  EXPECT_NE(hlog.find(hpath), std::string::npos) << hlog;
  EXPECT_NE(hlog.find("must lie in [0, 1e6]"), std::string::npos) << hlog;

  const auto [bcode, blog] = spawn(with({"--max-rel-bpb", "0.001"}), "eval_below");
  EXPECT_EQ(bcode, 2) << blog;
  EXPECT_NE(blog.find("lists no target at or below it"), std::string::npos) << blog;
  const std::string missing = (dir / "none.json").string();
  // Only full and error-target rows: the report and CSV are written, the figure (budget rows) is not, exit 0.
  const std::string prefix = (dir / "targets_only").string();
  const auto [ocode, olog] = spawn(with({"--max-rel-bpb", "1", "--out", prefix}), "eval_out");
  EXPECT_EQ(ocode, 0) << olog;
  EXPECT_TRUE(fs::exists(prefix + ".md")) << olog;
  EXPECT_TRUE(fs::exists(prefix + ".csv")) << olog;
  EXPECT_NE(olog.find("not drawn: no policy but full has budget rows to plot"), std::string::npos) << olog;
  const auto [mcode, mlog] = spawn(with({"--max-rel-bpb", "1", "--calibration", missing}), "eval_missing");
  EXPECT_EQ(mcode, 1) << mlog;
  EXPECT_NE(mlog.find(missing), std::string::npos) << mlog;
  // A file whose policy cannot run with an error target (screening is a budget-mode option) is a bad file: exit 1,
  // naming the file and the field, before the model loads.
  auto screen = [](nlohmann::json& c) { c["policy"] = "minimax:max_keep_fraction=0.5"; };
  const auto [scode, slog, bad] = eval_edited("screened", screen);
  EXPECT_EQ(scode, 1) << slog;
  EXPECT_NE(slog.find("KV calibration '" + bad + "': field 'policy' (minimax:max_keep_fraction=0.5) does not make an error-target policy"),
            std::string::npos)
      << slog;
  // A file without choices is a bad file (exit 1) naming the field.
  const auto [ncode, nlog, no_choices] =
      eval_edited("no_choices", [](nlohmann::json& c) { c["choices"] = nlohmann::json::array(); });
  EXPECT_EQ(ncode, 1) << nlog;
  EXPECT_NE(nlog.find("KV calibration '" + no_choices + "': field 'choices' is empty"), std::string::npos) << nlog;
  // kv-calibrate refuses, before any document runs: a policy other than minimax, a repeated grid value, an --out
  // it cannot write.
  for (const auto& [extra, message] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--policy", "window"}, "kv-calibrate: --policy window: only minimax takes an error target"},
           {{"--grid", "0.1,0.1"}, "kv-calibrate: grid value 0.1 is given twice"},
           {{"--out", (dir / "no_such_folder" / "cal.json").string()}, "kv-calibrate: --out"},
           {{"--out", ""}, "must not be empty"},
           {{"--max-docs", "3"}, "3 documents cannot bound coverage 0.9 (split conformal needs at least 9): raise "
                                 "--max-docs"},
           // All 6 documents used: --max-docs would not help, and the message does not suggest it.
           {{"--max-docs", "32"}, "6 documents cannot bound coverage 0.9 (split conformal needs at least 9): every "
                                  "long enough document is used"}}) {
    std::vector<std::string> args{DCP_BINARY, "kv-calibrate", "--checkpoint", ckpt.string(), "--data.path",
                                  setup().corpus.string(), "--split", "all", "--context", "128", "--continuation", "32"};
    args.insert(args.end(), extra.begin(), extra.end());
    const auto [ucode, ulog] = spawn(args, "calibrate_usage");
    EXPECT_EQ(ucode, 2) << extra.front() << ": " << ulog;
    EXPECT_NE(ulog.find(message), std::string::npos) << ulog;
    EXPECT_EQ(ulog.find("document 1/"), std::string::npos) << ulog;
  }
  // dcp generate with an error target says which max_rel_error the checkpoint's calibration chose.
  const auto [tcode, tlog] = spawn({DCP_BINARY, "generate", "--checkpoint", ckpt.string(), "--prompt", "ab",
                                    "--max-new-tokens", "2", "--kv.max_rel_bpb", "1"},
                                   "generate_target");
  EXPECT_EQ(tcode, 0) << tlog;
  std::ostringstream said;
  said << "kv.max_rel_bpb 1: minimax at max_rel_error " << chosen << " (calibration '" << file.string() << "'";
  EXPECT_NE(tlog.find(said.str()), std::string::npos) << said.str() << "\n" << tlog;
  // dcp generate with an error target refuses a policy or budget beside it (they would be dropped).
  const auto [pcode, plog] = spawn({DCP_BINARY, "generate", "--checkpoint", ckpt.string(), "--prompt", "ab",
                                    "--max-new-tokens", "2", "--kv.max_rel_bpb", "1", "--kv.policy", "window"},
                                   "generate_policy");
  EXPECT_EQ(pcode, 2) << plog;
  EXPECT_NE(plog.find("--kv.policy and --kv.budget cannot be given with it"), std::string::npos) << plog;
  // dcp generate reads the checkpoint's own calibration: the same file there is refused the same way.
  nlohmann::json screened = cal;
  screen(screened);
  std::ofstream(file) << screened.dump(2);
  const auto [gcode, glog] = spawn({DCP_BINARY, "generate", "--checkpoint", ckpt.string(), "--prompt", "ab",
                                    "--max-new-tokens", "2", "--kv.max_rel_bpb", "1"},
                                   "generate_screened");
  EXPECT_EQ(gcode, 1) << glog;
  EXPECT_NE(glog.find("KV calibration '" + file.string() + "': field 'policy' (minimax:max_keep_fraction=0.5)"),
            std::string::npos)
      << glog;
}
