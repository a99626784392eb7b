// dcp kv-eval's pieces: the statistics over documents, the attention error of a compressed cache, the choice of
// documents, the driver on a tiny random model (full = the reference exactly, window visibly not), the report
// writers, and kv_policy_names (every name is one make_kv_policy builds).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "dcp/config.h"
#include "dcp/infer.h"
#include "tools/kv_calibrate.h"
#include "tools/kv_eval.h"
#include "tools/kv_eval_report.h"
#include "dcp/kv_policies.h"
#include "unit/error_of.h"
#include "unit/kv_test_model.h"

using namespace dcp;
using dcp::test::error_of;
using dcp::test::sharp_model;

namespace {

KvHeadView random_view(int64_t n, int64_t d, uint64_t seed) {
  torch::manual_seed(seed);
  KvHeadView v;
  v.keys = torch::randn({n, d}) * 2;
  v.values = torch::randn({n, d});
  v.bias = torch::zeros({n});
  v.positions = torch::arange(n, torch::kInt64);
  return v;
}

KvHeadView rows(const KvHeadView& v, const torch::Tensor& keep) {
  return {v.keys.index_select(0, keep), v.values.index_select(0, keep), v.bias.index_select(0, keep),
          v.positions.index_select(0, keep)};
}

KvEvalOptions small_options() {
  KvEvalOptions o;
  o.policies = {"full", "window"};
  o.budgets = {0.1, 0.5};
  o.context = 96;
  o.continuation = 24;
  o.chunk_tokens = 16;
  o.bootstrap_resamples = 200;
  o.seed = 3;
  return o;
}

std::vector<KvEvalDocument> random_documents(int64_t count, int64_t tokens, uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<KvEvalDocument> docs;
  for (int64_t i = 0; i < count; ++i) {
    auto t = torch::randint(97, 123, {tokens}, torch::kInt64);
    KvEvalDocument d{"doc" + std::to_string(i), std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + tokens)};
    d.tokens[0] = kBosToken;
    docs.push_back(std::move(d));
  }
  return docs;
}

}  // namespace

TEST(KvEvalStats, WorstFractionMeanTakesTheLargestTenPercentAtLeastOne) {
  EXPECT_DOUBLE_EQ(worst_fraction_mean({1, 5, 3}), 5);  // ceil(0.3) = 1
  std::vector<double> v;
  for (int i = 0; i < 30; ++i) v.push_back(i);
  EXPECT_DOUBLE_EQ(worst_fraction_mean(v), (29 + 28 + 27) / 3.0);  // exactly 3 of 30, not 4
  EXPECT_DOUBLE_EQ(worst_fraction_mean(v, 1.0), mean_of(v));
  EXPECT_NE(error_of([] { worst_fraction_mean({}); }).find("no values"), std::string::npos);
  EXPECT_NE(error_of([] { worst_fraction_mean({1}, 0); }).find("fraction 0 outside"), std::string::npos);
}

TEST(KvEvalStats, BootstrapIsSeededAndBracketsTheMean) {
  std::vector<double> v;
  for (int i = 0; i < 40; ++i) v.push_back(std::sin(i) + 0.1 * i);
  const KvEvalStat a = bootstrap_stat(v, mean_of, 1000, 7), b = bootstrap_stat(v, mean_of, 1000, 7);
  EXPECT_EQ(a.ci, b.ci);
  EXPECT_DOUBLE_EQ(a.value, mean_of(v));
  EXPECT_LT(a.ci[0], a.value);
  EXPECT_GT(a.ci[1], a.value);
  // The interval of a mean shrinks like 1/sqrt(n): about 2 x 1.96 standard errors wide.
  double var = 0;
  for (double x : v) var += (x - a.value) * (x - a.value);
  const double se = std::sqrt(var / (v.size() - 1) / v.size());
  EXPECT_NEAR(a.ci[1] - a.ci[0], 2 * 1.96 * se, 0.6 * se);
  const KvEvalStat c = bootstrap_stat({2.5}, mean_of, 10, 1);
  EXPECT_EQ(c.ci, (std::array<double, 2>{2.5, 2.5}));
  EXPECT_NE(error_of([] { bootstrap_stat({1}, mean_of, 0, 1); }).find("resamples 0"), std::string::npos);
}

TEST(KvEvalStats, ClusterBootstrapResamplesFilesNotDocuments) {
  std::vector<double> v;
  std::vector<int64_t> own;
  for (int i = 0; i < 30; ++i) {
    v.push_back(std::cos(i) + 0.05 * i);
    own.push_back(i);
  }
  // One document per file: the cluster bootstrap is the plain bootstrap (the same draws, seed for seed).
  const KvEvalStat plain = bootstrap_stat(v, mean_of, 500, 9), single = kv_eval_bootstrap(v, own, 500, 9);
  EXPECT_DOUBLE_EQ(single.value, plain.value);
  EXPECT_NEAR(single.ci[0], plain.ci[0], 1e-12);
  EXPECT_NEAR(single.ci[1], plain.ci[1], 1e-12);
  // Each file cut into three identical documents: resampling files gives the interval of the 30 files, while
  // treating the 90 documents as independent would claim one about sqrt(3) narrower.
  std::vector<double> triple;
  std::vector<int64_t> files;
  for (int i = 0; i < 30; ++i) {
    for (int c = 0; c < 3; ++c) {
      triple.push_back(v[static_cast<size_t>(i)]);
      files.push_back(i);
    }
  }
  const KvEvalStat clustered = kv_eval_bootstrap(triple, files, 500, 9);
  EXPECT_NEAR(clustered.ci[0], plain.ci[0], 1e-12);
  EXPECT_NEAR(clustered.ci[1], plain.ci[1], 1e-12);
  const KvEvalStat naive = bootstrap_stat(triple, mean_of, 500, 9);
  EXPECT_LT(naive.ci[1] - naive.ci[0], 0.8 * (clustered.ci[1] - clustered.ci[0]));
  EXPECT_NE(error_of([] { kv_eval_bootstrap({1, 2}, {0}, 10, 1); }).find("1 cluster ids for 2 values"), std::string::npos);
  EXPECT_NE(error_of([] { kv_eval_bootstrap({1, 2}, {0, 2}, 10, 1); }).find("cluster id 1 has no value"),
            std::string::npos);
}

TEST(KvEvalStats, QuantileIntervalIsTheBinomialOrderStatisticsAndCovers) {
  // 1..64: the 0.9 quantile is x_(58); the equal-tailed 95% interval by hand from Binomial(64, 0.9).
  std::vector<double> v;
  for (int i = 1; i <= 64; ++i) v.push_back(i);
  std::vector<double> cdf;
  double acc = 0;
  for (int j = 0; j <= 64; ++j) {
    double log_c = 0;
    for (int t = 1; t <= j; ++t) log_c += std::log(static_cast<double>(64 - j + t) / t);
    acc += std::exp(log_c + j * std::log(0.9) + (64 - j) * std::log(0.1));
    cdf.push_back(acc);
  }
  int l = 0, u = 65;
  for (int i = 1; i <= 64; ++i) if (cdf[i - 1] <= 0.025) l = i;
  for (int i = 64; i >= 1; --i) if (cdf[i - 1] >= 0.975) u = i;
  const KvEvalStat q = kv_quantile_with_ci(v, 0.9);
  EXPECT_EQ(q.value, 58);
  EXPECT_EQ(q.ci[0], l);
  if (u <= 64) EXPECT_EQ(q.ci[1], u); else EXPECT_TRUE(std::isinf(q.ci[1]));
  EXPECT_LT(q.ci[0], 58);
  EXPECT_GT(q.ci[1], 58);
  // Coverage over 2000 samples of 64 uniform draws: the true 0.9 quantile is 0.9; the interval holds it in
  // >= 95% of samples (>= 93.5% allows for the simulation's own noise, sd 0.5%).
  std::mt19937_64 rng(5);
  int covered = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<double> x;
    for (int i = 0; i < 64; ++i) x.push_back(static_cast<double>(rng() >> 11) / 9007199254740992.0);
    const KvEvalStat s = kv_quantile_with_ci(x, 0.9);
    covered += s.ci[0] <= 0.9 && 0.9 <= s.ci[1];
  }
  EXPECT_GE(covered, 1870);
  // Too few documents to bound the upper end: +inf, not a made-up number.
  EXPECT_TRUE(std::isinf(kv_quantile_with_ci({1, 2, 3, 4, 5}, 0.9).ci[1]));
  EXPECT_NE(error_of([] { kv_quantile_with_ci({}, 0.9); }).find("no values"), std::string::npos);
  EXPECT_NE(error_of([] { kv_quantile_with_ci({1}, 1.0); }).find("must lie in (0, 1)"), std::string::npos);
}

TEST(KvEvalSplit, CalibrationAndEvaluationAreDisjointHalvesBySourceFile) {
  DataConfig cfg;
  cfg.max_seq_len = 50;  // longer documents are several samples: "name#0", "name#1", ...
  cfg.heldout_fraction = 0;
  std::vector<std::pair<std::string, std::string>> docs;
  for (int i = 0; i < 40; ++i) docs.push_back({"file" + std::to_string(i) + ".py", std::string(120 + i, 'a' + i % 26)});
  const Corpus corpus = Corpus::from_documents(docs, cfg);
  const auto cal = kv_eval_split(corpus, corpus.train_ids(), "calibration");
  const auto eval = kv_eval_split(corpus, corpus.train_ids(), "evaluation");
  EXPECT_EQ(cal.size() + eval.size(), corpus.train_ids().size());
  std::set<std::string> cal_files, eval_files;
  for (int64_t id : cal) cal_files.insert(kv_source_file(corpus.samples()[static_cast<size_t>(id)].source));
  for (int64_t id : eval) eval_files.insert(kv_source_file(corpus.samples()[static_cast<size_t>(id)].source));
  for (const auto& f : cal_files) EXPECT_EQ(eval_files.count(f), 0u) << f;  // every chunk of a file on one side
  EXPECT_GT(cal_files.size(), 8u);
  EXPECT_GT(eval_files.size(), 8u);
  EXPECT_EQ(kv_source_file("/a/b#c.py#3"), "/a/b#c.py");
  // The distinct files of documents given out of order, one file twice: sorted, each once.
  const std::vector<KvEvalDocument> unsorted{{"/c/z.py#1", {}}, {"/c/a.py#0", {}}, {"/c/z.py#0", {}}, {"/c/m.py#4", {}}};
  EXPECT_EQ(kv_source_files(unsorted), (std::vector<std::string>{"/c/a.py", "/c/m.py", "/c/z.py"}));
  EXPECT_NE(error_of([&] { kv_eval_split(corpus, corpus.train_ids(), "test"); }).find("split 'test'"), std::string::npos);
}

TEST(KvCalibration, ChoosesTheLargestErrorBoundWithinEachTargetAndRoundTrips) {
  KvCalibration c;
  c.context = 96;
  c.continuation = 32;
  c.documents = 10;
  c.source_files = 7;
  c.grid = {{0.01, 0.001, 0.002, 0.9}, {0.02, 0.003, 0.006, 0.6}, {0.04, 0.008, 0.015, 0.4}, {0.08, 0.02, 0.04, 0.2}};
  c.choices = {{0.005, 0.01, 0.002, 0.9}, {0.01, 0.02, 0.006, 0.6}, {0.02, 0.04, 0.015, 0.4}, {0.001, 0, 0, 0}};
  const KvCalibration back = kv_calibration_from_json(kv_calibration_json(c), "test");
  ASSERT_EQ(back.choices.size(), 4u);
  EXPECT_EQ(back.choices[0].max_rel_bpb, 0.001);  // sorted by target
  EXPECT_EQ(back.grid.size(), 4u);
  EXPECT_EQ(kv_calibrated_target(back, 0.01).max_rel_error, 0.02);
  // A target between listed ones takes the one below it (conservative).
  EXPECT_EQ(kv_calibrated_target(back, 0.015).max_rel_error, 0.02);
  EXPECT_EQ(kv_calibrated_target(back, 0.015).max_rel_bpb, 0.015);
  EXPECT_NE(error_of([&] { kv_calibrated_target(back, 0.0005); }).find("no target at or below it"), std::string::npos);
  EXPECT_NE(error_of([&] { kv_calibrated_target(back, 0.002); }).find("no max_rel_error of the grid"), std::string::npos);
  EXPECT_NE(error_of([] { kv_calibration_from_json(nlohmann::json{{"format", "x"}}, "f.json"); }).find("'f.json'"),
            std::string::npos);
  EXPECT_NE(error_of([] { read_kv_calibration("/nonexistent/kv_calibration.json"); }).find("cannot be read"),
            std::string::npos);
  // Hand-edited files that kv-calibrate cannot have written: a choice off the grid, a count below 1.
  nlohmann::json off = kv_calibration_json(c);
  off["choices"][1]["max_rel_error"] = 0.03;
  EXPECT_NE(error_of([&] { kv_calibration_from_json(off, "f.json"); })
                .find("field 'choices[1].max_rel_error' 0.03 is not a max_rel_error of the grid"),
            std::string::npos);
  for (const char* field : {"context", "continuation", "documents", "source_files"}) {
    nlohmann::json bad = kv_calibration_json(c);
    bad[field] = field == std::string("documents") ? -3 : 0;
    EXPECT_NE(error_of([&] { kv_calibration_from_json(bad, "f.json"); }).find(fmt::format("field '{}' ", field)),
              std::string::npos)
        << field;
  }
}

// Split conformal's rank ceil((n + 1) coverage), by hand; +inf when it exceeds n.
TEST(KvCalibration, ConformalBoundIsTheCeilNPlusOneCoverageSmallest) {
  std::vector<double> ten{10, 9, 8, 7, 6, 5, 4, 3, 2, 1};
  EXPECT_EQ(kv_conformal_bound(ten, 0.9), 10);  // ceil(11 x 0.9) = 10
  EXPECT_EQ(kv_conformal_bound(ten, 0.8), 9);   // ceil(8.8) = 9
  EXPECT_EQ(kv_conformal_bound(ten, 0.5), 6);   // ceil(5.5) = 6
  std::vector<double> n32(32);
  for (size_t i = 0; i < n32.size(); ++i) n32[i] = static_cast<double>(31 - i);
  EXPECT_EQ(kv_conformal_bound(n32, 0.9), 29);  // ceil(33 x 0.9) = 30th smallest of 0..31
  EXPECT_TRUE(std::isinf(kv_conformal_bound({1, 2, 3}, 0.9)));
  EXPECT_EQ(kv_conformal_min_documents(0.9), 9);
  EXPECT_EQ(kv_conformal_min_documents(0.8), 4);
  EXPECT_TRUE(std::isinf(kv_conformal_bound(std::vector<double>(8, 0.0), 0.9)));
  EXPECT_EQ(kv_conformal_bound(std::vector<double>(9, 0.0), 0.9), 0.0);
  EXPECT_NE(error_of([] { kv_conformal_bound({1}, 1.0); }).find("coverage 1 must lie in (0, 1)"), std::string::npos);
}

// The same file through another spelling of its folder (relative, "..", a symlink) is the same source file.
TEST(KvEvalSplit, SourceFileIsTheSameWhateverTheFolderSpelling) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / fmt::format("dcp_kv_source_{}", ::getpid());
  fs::create_directories(root / "real");
  std::ofstream(root / "real" / "a.py") << "x";
  fs::create_directory_symlink(root / "real", root / "link");
  const std::string real = kv_source_file((root / "real" / "a.py").string() + "#3");
  EXPECT_EQ(real, (fs::canonical(root / "real") / "a.py").string());
  EXPECT_EQ(kv_source_file((root / "link" / "a.py").string()), real);
  EXPECT_EQ(kv_source_file((root / "link" / ".." / "real" / "a.py").string() + "#1"), real);
  const fs::path cwd = fs::current_path();
  fs::current_path(root);
  EXPECT_EQ(kv_source_file("real/a.py"), real);
  EXPECT_EQ(kv_source_file("./link/a.py#2"), real);
  fs::current_path(cwd);
  fs::remove_all(root);
}

// The fingerprint of fixed weights is pinned: a change (of the hash, or of the parameters' names, order or shapes)
// makes every calibration file written before it be refused, so it must be deliberate.
TEST(KvCalibration, WeightsFingerprintOfFixedWeightsIsPinned) {
  Transformer m = dcp::test::sharp_model(3);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : m->parameters()) {  // exact in fp32: multiples of 0.25 in [-31, 31.5]
      p.copy_(torch::arange(p.numel(), torch::kFloat).remainder(251).mul(0.25).sub(31).reshape(p.sizes()));
    }
  }
  EXPECT_EQ(kv_weights_fingerprint(m), "f253413d0eaa2b64");
}

// A calibration is tied to its model by the weights fingerprint and to its documents by their source files.
TEST(KvCalibration, RecordsTheWeightsAndSourcesAndRefusesOtherWeights) {
  Transformer a = dcp::test::sharp_model(3), b = dcp::test::sharp_model(3), c = dcp::test::sharp_model(4);
  const std::string fa = kv_weights_fingerprint(a);
  EXPECT_EQ(fa.size(), 16u);
  EXPECT_EQ(kv_weights_fingerprint(b), fa);  // the same weights
  EXPECT_NE(kv_weights_fingerprint(c), fa);
  {
    torch::NoGradGuard no_grad;
    b->parameters()[0].view(-1)[0].add_(1e-3f);  // one weight changed
  }
  EXPECT_NE(kv_weights_fingerprint(b), fa);
  KvCalibration cal;
  cal.context = 96;
  cal.continuation = 32;
  cal.documents = 10;
  cal.source_files = 2;
  cal.grid = {{0.02, 0.003, 0.006, 0.6}};
  cal.checkpoint = "ckpt";
  cal.weights = fa;
  cal.sources = {kv_source_file("x/a.py"), kv_source_file("x/b.py")};
  cal.choices = {{0.01, 0.02, 0.006, 0.6}};
  const KvCalibration back = kv_calibration_from_json(kv_calibration_json(cal), "test");
  EXPECT_EQ(back.weights, fa);
  EXPECT_EQ(back.sources, cal.sources);
  EXPECT_EQ(kv_check_calibration_weights(back, fa, "f.json"), "");
  EXPECT_NE(error_of([&] { kv_check_calibration_weights(back, kv_weights_fingerprint(c), "f.json"); })
                .find("KV calibration 'f.json' was made for other weights (fingerprint " + fa + ", checkpoint 'ckpt')"),
            std::string::npos);
  KvCalibration old = back;
  old.weights.clear();
  EXPECT_NE(kv_check_calibration_weights(old, fa, "f.json").find("records no weights fingerprint"), std::string::npos);
  // Overlap by source file: a document of a file the calibration used, whatever its part (#k).
  std::vector<KvEvalDocument> docs(3);
  docs[0].source = "x/b.py#2";
  docs[1].source = "x/c.py";
  docs[2].source = "x/b.py";
  EXPECT_EQ(kv_calibration_overlap(back, docs), std::vector<std::string>{kv_source_file("x/b.py")});
  // A choice no kv-calibrate grid could hold is a bad file.
  nlohmann::json j = kv_calibration_json(cal);
  j["choices"][0]["max_rel_error"] = 1e300;
  EXPECT_NE(error_of([&] { kv_calibration_from_json(j, "f.json"); }).find("must lie in [0, 1e6]"), std::string::npos);
  nlohmann::json twice = kv_calibration_json(cal);
  twice["choices"].push_back(twice["choices"][0]);
  EXPECT_NE(error_of([&] { kv_calibration_from_json(twice, "f.json"); }).find("field 'choices' lists the target 0.01 twice"),
            std::string::npos);
}

TEST(KvAttentionRelErr, ZeroForTheSameEntriesPositiveWhenEvictedAndBiasCountsCopies) {
  const KvHeadView full = random_view(40, 16, 1);
  const torch::Tensor q = torch::randn({5, 16}) * 2;
  const double scale = 0.25;
  EXPECT_EQ(kv_attention_rel_err(full, full, q, scale).abs().max().item<double>(), 0.0);
  const torch::Tensor err = kv_attention_rel_err(full, rows(full, torch::arange(30, 40, torch::kInt64)), q, scale);
  EXPECT_EQ(err.numel(), 5);
  EXPECT_GT(err.min().item<double>(), 0.01);
  // A full view with entry 0 stored twice equals one copy with bias log 2.
  KvHeadView doubled = rows(full, torch::cat({torch::zeros({1}, torch::kInt64), torch::arange(40, torch::kInt64)}));
  KvHeadView weighted = full;
  weighted.bias = full.bias.clone();
  weighted.bias[0] = std::log(2.0);
  // Up to the rounding of log 2 to fp32 (cache biases are fp32: 3e-8 relative in the weight).
  EXPECT_LT(kv_attention_rel_err(doubled, weighted, q, scale).max().item<double>(), 1e-7);
  // A visibly different weight is visible.
  weighted.bias[0] = std::log(2.2);
  EXPECT_GT(kv_attention_rel_err(doubled, weighted, q, scale).max().item<double>(), 1e-4);
  EXPECT_NE(error_of([&] { kv_attention_rel_err(full, full, q, 0); }).find("scale 0"), std::string::npos);
  EXPECT_NE(error_of([&] { kv_attention_rel_err(full, full, torch::randn({5, 8}), 1); }).find("do not fit"),
            std::string::npos);
}

TEST(KvPolicySpec, NameAndOptionsInOneStringEachErrorNamed) {
  const KvPolicySpec m = parse_kv_policy_spec("minimax:abstain_tail=0.3:window=8");
  EXPECT_EQ(m.name, "minimax");
  EXPECT_EQ(m.options, (KvPolicyOptions{{"abstain_tail", 0.3}, {"window", 8}}));
  EXPECT_EQ(parse_kv_policy_spec("snapkv").options.size(), 0u);
  const std::pair<const char*, const char*> bad[] = {
      {":window=8", "KV policy ':window=8': no policy name"},
      {"minimax:abstain_tail", "'abstain_tail': expected KEY=VALUE"},
      {"minimax:", "'': expected KEY=VALUE"},
      {"minimax:=3", "'=3': expected KEY=VALUE"},
      {"minimax:window=nan", "'window=nan': expected KEY=VALUE with a finite decimal"},
      {"minimax:window=0x10", "'window=0x10': expected"},
      {"minimax:window=1:window=2", "window is given twice"}};
  for (const auto& [spec, message] : bad) {
    EXPECT_NE(error_of([&] { parse_kv_policy_spec(spec); }).find(message), std::string::npos) << spec;
  }
  // kv-eval builds every spec with every budget before running; the budget is its own.
  KvEvalOptions o = small_options();
  o.policies = {"window:n_sink=2", "minimax:abstain_tail=0.3"};
  EXPECT_NO_THROW(o.validate());
  o.policies = {"window:budget=0.5"};
  EXPECT_NE(error_of([&] { o.validate(); }).find("policy 'window:budget=0.5' sets budget"), std::string::npos);
  o.policies = {"window:kernel=3"};
  EXPECT_NE(error_of([&] { o.validate(); }).find("window has no option 'kernel'"), std::string::npos);
  o.policies = {"full:n_sink=1"};
  EXPECT_NE(error_of([&] { o.validate(); }).find("full has no option 'n_sink'"), std::string::npos);
}

TEST(KvEval, AbstentionIsCountedPerHead) {
  Transformer model = sharp_model(11, Precision::kFp32, 2);
  KvEvalOptions o = small_options();
  // Every block abstains (kept whole: exceed_budget) or none can.
  o.policies = {"minimax:abstain_tail=0:exceed_budget=1", "minimax:abstain_tail=1"};
  o.budgets = {0.25};
  const KvEvalResult r = run_kv_eval(model, random_documents(2, 130, 5), o);
  ASSERT_EQ(r.rows.size(), 2u);
  EXPECT_EQ(r.rows[0].policy, "minimax:abstain_tail=0:exceed_budget=1");
  EXPECT_EQ(r.rows[0].abstained_heads, 8);
  EXPECT_EQ(r.rows[0].abstained_by_head, std::vector<double>(8, 1.0));
  EXPECT_EQ(r.rows[1].abstained_heads, 0);
  EXPECT_EQ(r.rows[1].abstained_by_head, std::vector<double>(8, 0.0));
  EXPECT_LT(r.rows[1].kv_bytes, r.rows[0].kv_bytes);
  EXPECT_LT(r.rows[1].kv_bytes_mean, r.rows[0].kv_bytes_mean);
  KvEvalReportInfo info;
  const std::string md = kv_eval_markdown(r, info);
  EXPECT_NE(md.find("| layer | head | minimax:abstain_tail=0:exceed_budget=1 0.25 |"), std::string::npos) << md;
  EXPECT_NE(md.find("| 1 | 2 | 1.00 |"), std::string::npos) << md;
}

TEST(KvPolicyNames, EveryNameIsOneMakeKvPolicyBuilds) {
  const auto& names = kv_policy_names();
  ASSERT_FALSE(names.empty());
  EXPECT_EQ(names.front(), "full");
  for (const auto& n : names) {
    if (n == "full") {
      EXPECT_NO_THROW(make_kv_policy(n)) << n;
    } else {
      EXPECT_NO_THROW(make_kv_policy(n, {{"budget", 0.25}})) << n;
    }
  }
  // The unknown-name error lists the same names.
  const std::string e = error_of([] { make_kv_policy("lru"); });
  for (const auto& n : names) EXPECT_NE(e.find(n), std::string::npos) << n;
}

TEST(KvEvalOptions, ValidateNamesTheField) {
  KvEvalOptions o = small_options();
  o.budgets = {0.5, std::nan("")};
  EXPECT_NE(error_of([&] { o.validate(); }).find("budget nan outside (0, 1]"), std::string::npos);
  o = small_options();
  o.budgets = {1.5};
  EXPECT_NE(error_of([&] { o.validate(); }).find("budget 1.5 outside"), std::string::npos);
  o = small_options();
  o.context = 0;
  EXPECT_NE(error_of([&] { o.validate(); }).find("context 0 must be >= 1"), std::string::npos);
  o = small_options();
  o.continuation = -3;
  EXPECT_NE(error_of([&] { o.validate(); }).find("continuation -3"), std::string::npos);
  o = small_options();
  o.policies.clear();
  EXPECT_NE(error_of([&] { o.validate(); }).find("no policy"), std::string::npos);
  o = small_options();
  o.policies = {"window", "minimax:window=8", "window"};
  EXPECT_NE(error_of([&] { o.validate(); }).find("policy 'window' is given twice"), std::string::npos);
  o = small_options();
  o.budgets = {0.1, 0.5, 0.1};
  EXPECT_NE(error_of([&] { o.validate(); }).find("budget 0.1 is given twice"), std::string::npos);
}

TEST(KvEvalDocuments, SkipsShortOnesCountsThemAndRefusesWhenNoneIsLongEnough) {
  DataConfig cfg;
  cfg.max_seq_len = 4096;
  cfg.heldout_fraction = 0;
  std::vector<std::pair<std::string, std::string>> docs;
  for (int i = 0; i < 5; ++i) docs.push_back({"long" + std::to_string(i), std::string(200 + i, 'a' + i)});
  docs.push_back({"short", std::string(50, 'z')});
  const Corpus corpus = Corpus::from_documents(docs, cfg);
  KvEvalOptions o = small_options();  // needs 96 + 24 + 1 = 121 tokens
  o.max_docs = 3;
  const KvEvalDocuments d = choose_kv_eval_documents(corpus, corpus.train_ids(), o);
  EXPECT_EQ(d.available, 6);
  EXPECT_EQ(d.too_short, 1);
  EXPECT_EQ(d.not_chosen, 2);
  EXPECT_EQ(d.required_tokens, 121);
  ASSERT_EQ(d.documents.size(), 3u);
  for (const auto& doc : d.documents) {
    EXPECT_EQ(doc.tokens[0], kBosToken);
    EXPECT_GE(doc.tokens.size(), 201u);
    EXPECT_EQ(doc.tokens[1], doc.tokens[2]);  // the document's bytes follow BOS
  }
  o.context = 300;
  EXPECT_NE(error_of([&] { choose_kv_eval_documents(corpus, corpus.train_ids(), o); })
                .find("none of the 6 documents has the 325 tokens needed (context 300 + continuation 24 + 1, BOS "
                      "included); the longest has 205"),
            std::string::npos);
}

TEST(KvEval, FullEqualsTheReferenceAndWindowDiffersOnPeakedAttention) {
  Transformer model = sharp_model(11, Precision::kFp32, 2);
  const KvEvalOptions o = small_options();
  const auto docs = random_documents(4, 130, 5);
  int64_t calls = 0;
  const KvEvalResult r = run_kv_eval(model, docs, o, [&](int64_t done, int64_t total) {
    EXPECT_EQ(done, ++calls);
    EXPECT_EQ(total, 4);
  });
  EXPECT_EQ(calls, 4);
  ASSERT_EQ(r.rows.size(), 4u);
  for (const auto& row : r.rows) {
    EXPECT_EQ(row.documents, 4);
    EXPECT_EQ(row.attn_rel_err_per_layer.size(), 2u);
    EXPECT_GT(row.bpb_full, 1);  // a random model: about log2(257) bits on random letters
    EXPECT_GT(row.prefill_s, 0);
    EXPECT_GT(row.decode_s, 0);
    EXPECT_EQ(row.abstained_heads, 0);
    if (row.policy == "full") {
      EXPECT_EQ(row.rel_bpb_increase.value, 0) << row.budget;
      EXPECT_EQ(row.worst_decile_rel_increase.value, 0);
      EXPECT_EQ(row.attn_rel_err.value, 0);
      EXPECT_EQ(row.kv_bytes, row.kv_bytes_full);
      EXPECT_EQ(row.token_accuracy, row.token_accuracy_full);
      EXPECT_EQ(row.exact_match, row.exact_match_full);
    }
    EXPECT_GE(row.token_accuracy, row.exact_match);  // every token right implies accuracy 1
    EXPECT_LE(row.token_accuracy, 1);
    EXPECT_EQ(row.abstained_by_head, std::vector<double>(8, 0.0));
  }
  EXPECT_TRUE(r.head_ablation.empty());  // not asked for
  const KvEvalRow& w10 = r.rows[2];
  const KvEvalRow& w50 = r.rows[3];
  ASSERT_EQ(w10.policy, "window");
  ASSERT_EQ(w10.budget, 0.1);
  EXPECT_NE(w10.bpb, w10.bpb_full);
  EXPECT_GT(w10.attn_rel_err.value, 0.05);
  EXPECT_GT(w10.attn_rel_err.value, w50.attn_rel_err.value);  // keeping more entries errs less
  EXPECT_GE(w10.worst_decile_rel_increase.value, w10.rel_bpb_increase.value);
  EXPECT_LE(w10.rel_bpb_increase.ci[0], w10.rel_bpb_increase.value);
  EXPECT_GE(w10.rel_bpb_increase.ci[1], w10.rel_bpb_increase.value);
  // window keeps ceil(0.1 x 96) = 10 entries per head after the prefill; the 24 decoded tokens are appended
  // and not compressed until position 128 (every policy's schedule, kKvDefaultInterval 64): 34 of 120 at the
  // end, and token i of the continuation reads 10 + i + 1 entries against the full cache's 96 + i + 1.
  EXPECT_DOUBLE_EQ(w10.kv_bytes / w10.kv_bytes_full, 34.0 / 120.0);
  EXPECT_DOUBLE_EQ(w10.kv_bytes_mean / w10.kv_bytes_full_mean, 22.5 / 108.5);
  EXPECT_DOUBLE_EQ(w10.kv_bytes_max / w10.kv_bytes_full_mean, 34.0 / 108.5);
  EXPECT_EQ(w10.rel_per_document.size(), 4u);
  EXPECT_EQ(r.source_files, 4);
  EXPECT_EQ(r.files, kv_source_files(docs));  // the clusters' files, as kv-calibrate records them
  EXPECT_TRUE(r.paired.empty());  // no minimax row to pair against

  // Report writers: JSON fields, CSV rows, the plot names every policy.
  KvEvalReportInfo info;
  info.split = "all";
  const nlohmann::json j = kv_eval_json(r, info);
  ASSERT_EQ(j["results"].size(), 4u);
  for (const char* key : {"policy", "budget", "bpb", "bpb_full", "token_accuracy", "exact_match", "rel_bpb_increase", "rel_bpb_increase_ci",
                          "worst_decile_rel_increase", "worst_decile_rel_increase_ci", "attn_rel_err",
                          "attn_rel_err_per_layer", "kv_bytes", "kv_bytes_full", "prefill_s", "decode_s",
                          "abstained_heads", "abstained_by_head", "kv_bytes_mean", "kv_bytes_max",
                          "kv_bytes_full_mean", "kv_bytes_mean_ratio", "worst_decile_mean",
                          "rel_bpb_increase_per_document", "max_rel_bpb"}) {
    EXPECT_TRUE(j["results"][2].contains(key)) << key;
  }
  EXPECT_EQ(j["head_ablation"].size(), 0u);
  EXPECT_EQ(j["results"][2]["abstained_by_head"][0].size(), 4u);
  EXPECT_EQ(j["results"][2]["rel_bpb_increase_ci"].size(), 2u);
  const std::string csv = kv_eval_csv(r);
  EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), 5);
  EXPECT_NE(csv.find("\nwindow,0.1,4,"), std::string::npos);
  const std::string plot = kv_eval_gnuplot_script(r, "x.csv", "x.png");
  EXPECT_NE(plot.find("title \"window\""), std::string::npos);
  EXPECT_EQ(plot.find("title \"full\""), std::string::npos);  // full sits at 1 and is not drawn
  EXPECT_NE(plot.find("using 27:"), std::string::npos);       // the x axis is the measured bytes
  const std::string md = kv_eval_markdown(r, info);
  EXPECT_NE(md.find("| window | 0.1 |"), std::string::npos);
  EXPECT_EQ(md.find("| layer | head |"), std::string::npos);  // no head table without ablation or abstention
}

// A cut changes what the heads read after prefill: nearly every head's cut shows on peaked random heads. A context
// the cut would keep whole is refused rather than reported as a head that needs nothing.
TEST(KvEval, HeadAblationCutsOneHeadAfterPrefill) {
  Transformer model = sharp_model(11, Precision::kFp32, 2);
  KvEvalOptions o = small_options();
  o.policies = {"full"};
  o.budgets = {1};
  o.head_ablation = true;
  const auto docs = random_documents(2, 130, 5);
  o.context = kKvAblationSinks + kKvAblationRecent;
  EXPECT_NE(error_of([&] { run_kv_eval(model, docs, o); }).find("context 20 must be longer"), std::string::npos);
  o.context = 96;
  const KvEvalResult cut = run_kv_eval(model, docs, o);
  ASSERT_EQ(cut.head_ablation.size(), 8u);
  int changed = 0;
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(cut.head_ablation[i].layer, static_cast<int64_t>(i / 4));
    EXPECT_EQ(cut.head_ablation[i].head, static_cast<int64_t>(i % 4));
    changed += cut.head_ablation[i].rel_bpb_increase != 0;
  }
  EXPECT_GE(changed, 6);  // peaked random heads read far entries: nearly every cut shows
  const nlohmann::json j = kv_eval_json(cut, KvEvalReportInfo{});
  ASSERT_EQ(j["head_ablation"].size(), 8u);
  EXPECT_EQ(j["head_ablation"][5]["layer"], 1);
  EXPECT_EQ(j["head_ablation"][5]["head"], 1);
  EXPECT_EQ(j["head_ablation"][5]["rel_bpb_increase"].get<double>(), cut.head_ablation[5].rel_bpb_increase);
  const std::string md = kv_eval_markdown(cut, KvEvalReportInfo{});
  EXPECT_NE(md.find(fmt::format("| 1 | 1 | {:.3f} | {:.3f} | {:+.1f}% |", cut.head_ablation[5].token_accuracy,
                                cut.head_ablation[5].exact_match, 100 * cut.head_ablation[5].rel_bpb_increase)),
            std::string::npos)
      << md;
}

TEST(KvEval, PairsEveryBaselineWithMinimaxAndRunsErrorTargets) {
  Transformer model = sharp_model(11, Precision::kFp32, 2);
  KvEvalOptions o = small_options();
  o.policies = {"full", "window", "minimax"};
  o.budgets = {0.25};
  o.targets = {KvEvalTarget{0.01, 0.05, 0.004, 0.5, "minimax"}};
  const KvEvalResult r = run_kv_eval(model, random_documents(3, 130, 6), o);
  ASSERT_EQ(r.rows.size(), 4u);  // full, window, minimax at 0.25, then the target row
  ASSERT_EQ(r.paired.size(), 1u);
  const KvEvalPaired& p = r.paired[0];
  EXPECT_EQ(p.candidate, "minimax");
  EXPECT_EQ(p.baseline, "window");
  EXPECT_EQ(p.documents, 3);
  double diff = 0;
  for (size_t i = 0; i < 3; ++i) diff += r.rows[2].rel_per_document[i] - r.rows[1].rel_per_document[i];
  EXPECT_NEAR(p.diff.value, diff / 3, 1e-15);
  EXPECT_NEAR(p.bytes_ratio, r.rows[2].kv_bytes_mean / r.rows[1].kv_bytes_mean, 1e-12);
  const KvEvalRow& t = r.rows[3];
  ASSERT_TRUE(t.target.has_value());
  EXPECT_EQ(t.target->max_rel_bpb, 0.01);
  EXPECT_EQ(t.target->max_rel_error, 0.05);
  EXPECT_EQ(t.target->calibrated_q90, 0.004);
  EXPECT_FALSE(r.rows[1].target.has_value());
  EXPECT_GE(t.within_target, 0);
  EXPECT_LE(t.within_target, 1);
  const std::string md = kv_eval_markdown(r, KvEvalReportInfo{});
  EXPECT_NE(md.find("| 0.25 | minimax | window |"), std::string::npos) << md;
  EXPECT_NE(md.find("| minimax @ max_rel_bpb 0.01 | - |"), std::string::npos) << md;
  EXPECT_NE(md.find("| 0.01 | 0.05 | +0.40% |"), std::string::npos) << md;
  o.paired_against = "snapkv";
  EXPECT_NE(error_of([&] { o.validate(); }).find("paired_against 'snapkv' is not among the policies"), std::string::npos);
  o.paired_against.clear();
  o.targets = {KvEvalTarget{0.01, 0, 0, 0, "minimax"}};
  EXPECT_NE(error_of([&] { o.validate(); }).find("both must be > 0"), std::string::npos);
}

TEST(KvEval, RefusesBadPoliciesBeforeRunning) {
  Transformer model = sharp_model(1, Precision::kFp32, 2);
  KvEvalOptions o = small_options();
  o.policies = {"window", "lru"};
  EXPECT_NE(error_of([&] { run_kv_eval(model, random_documents(1, 130, 1), o); }).find("unknown policy 'lru'"),
            std::string::npos);
  o = small_options();
  EXPECT_NE(error_of([&] { run_kv_eval(model, random_documents(1, 100, 1), o); }).find("has 100 tokens, fewer"),
            std::string::npos);
}
