// `dcp bench` report: the numbers computed from synthetic runs, and the files read from a run_dir.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "tools/bench_report.h"

namespace fs = std::filesystem;
using dcp::BenchRow;
using dcp::BenchRun;
using dcp::BenchStep;

namespace {

BenchStep step(int64_t n, int64_t tokens, double seconds, double imbalance, std::optional<double> predicted,
               std::optional<double> peak = std::nullopt) {
  BenchStep s;
  s.step = n;
  s.tokens = tokens;
  s.step_time_s = seconds;
  s.imbalance = imbalance;
  s.predicted_step_s = predicted;
  s.peak_bytes = peak;
  return s;
}

// Steps 1 and 3 are warm-ups (two slices of 2 steps); step 1 has no prediction.
BenchRun bucket_run() {
  BenchRun r;
  r.planner = "bucket";
  r.steps = {step(1, 1000, 9.0, 0.9, std::nullopt), step(2, 1000, 2.0, 0.1, 2.2),
             step(3, 1000, 9.0, 0.9, 1.0), step(4, 1000, 2.0, 0.3, 1.6)};
  r.heldout_bits_per_byte_final = 3.25;
  return r;
}

BenchRun opt_run() {
  BenchRun r;
  r.planner = "dcp-opt";
  r.steps = {step(1, 1000, 9.0, 0.5, std::nullopt, 5e6), step(2, 1000, 1.0, 0.0, 1.1, 7e6),
             step(3, 1000, 9.0, 0.5, 9.0, 9e9), step(4, 1000, 1.0, 0.2, 0.8, 6e6)};
  r.heldout_bits_per_byte_final = 3.2501;
  r.peak_bytes = 8e6;
  return r;
}

const std::set<int64_t> kWarmup = {1, 3};

}  // namespace

TEST(BenchReport, SummarizesTheMeasuredStepsOnly) {
  BenchRow row = dcp::summarize_bench_run(bucket_run(), kWarmup);
  EXPECT_EQ(row.steps, 4);
  EXPECT_EQ(row.steps_measured, 2);
  EXPECT_EQ(row.tokens, 2000);
  EXPECT_DOUBLE_EQ(row.tokens_per_s, 2000.0 / 4.0);
  EXPECT_DOUBLE_EQ(row.mean_imbalance, 0.2);
  EXPECT_EQ(row.steps_predicted, 2);
  EXPECT_DOUBLE_EQ(*row.mean_predicted_s, 1.9);
  EXPECT_DOUBLE_EQ(*row.mean_measured_s, 2.0);
  // errors 0.1 and 0.2: the median of an even count is the mean of the middle two
  EXPECT_NEAR(*row.median_prediction_error, 0.15, 1e-12);
  EXPECT_FALSE(row.peak_bytes.has_value());
  EXPECT_DOUBLE_EQ(*row.heldout_bits_per_byte_final, 3.25);
}

TEST(BenchReport, PeakMemoryIsTheLargestOfSummaryAndMeasuredSteps) {
  // step 3 (9e9) is a warm-up step and does not count; summary 8e6 beats the steps' 7e6
  EXPECT_DOUBLE_EQ(*dcp::summarize_bench_run(opt_run(), kWarmup).peak_bytes, 8e6);
  BenchRun r = opt_run();
  r.peak_bytes.reset();
  EXPECT_DOUBLE_EQ(*dcp::summarize_bench_run(r, kWarmup).peak_bytes, 7e6);
}

TEST(BenchReport, SortsFastestFirstWithSpeedupVsBestStatic) {
  BenchRun packed = bucket_run();  // a faster static planner than bucket: it becomes the reference
  packed.planner = "packed";
  for (auto& s : packed.steps) s.step_time_s *= 0.8;
  auto rows = dcp::summarize_bench({bucket_run(), opt_run(), packed}, kWarmup);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].planner, "dcp-opt");
  EXPECT_EQ(rows[1].planner, "packed");
  EXPECT_DOUBLE_EQ(*rows[0].speedup_vs_best_static, 2.0 * 0.8);
  EXPECT_DOUBLE_EQ(*rows[1].speedup_vs_best_static, 1.0);
  // without a static run there is nothing to compare to
  auto alone = dcp::summarize_bench({opt_run()}, kWarmup);
  EXPECT_FALSE(alone[0].speedup_vs_best_static.has_value());
  EXPECT_TRUE(dcp::is_static_planner("static"));
  EXPECT_FALSE(dcp::is_static_planner("dcp-inter-pac"));
}

TEST(BenchReport, ModelPredictedThroughputNeedsEveryMeasuredStepModelled) {
  BenchRun r = bucket_run();
  for (auto& s : r.steps) s.model_step_s = 4.0;
  EXPECT_DOUBLE_EQ(*dcp::summarize_bench_run(r, kWarmup).model_tokens_per_s, 2000.0 / 8.0);
  r.steps[3].model_step_s.reset();  // a measured step without it: no number rather than a biased one
  EXPECT_FALSE(dcp::summarize_bench_run(r, kWarmup).model_tokens_per_s.has_value());
}

TEST(BenchReport, RepetitionsComparePlannersSliceBySlice) {
  // Slices of 2 steps: repetition 1 = step 2, repetition 2 = step 4 (1 and 3 are warm-ups).
  BenchRun packed = bucket_run();
  packed.planner = "packed";
  packed.steps[3].step_time_s = 0.5;  // beats dcp-opt in repetition 2
  const auto reps = dcp::summarize_repetitions({packed, opt_run()}, kWarmup, 2);
  ASSERT_EQ(reps.size(), 2u);
  EXPECT_EQ(reps[0].tokens_per_s[0].first, "packed");
  EXPECT_DOUBLE_EQ(reps[0].tokens_per_s[0].second, 500.0);
  EXPECT_DOUBLE_EQ(reps[0].tokens_per_s[1].second, 1000.0);
  EXPECT_DOUBLE_EQ(reps[1].tokens_per_s[0].second, 2000.0);
  const std::string md = dcp::bench_repetition_table(reps);
  EXPECT_NE(md.find("| 1 | 500 | 1000 | dcp-opt | 2.000 |"), std::string::npos) << md;
  EXPECT_NE(md.find("| 2 | 2000 | 1000 | packed | 0.500 |"), std::string::npos) << md;
  EXPECT_THROW(dcp::summarize_repetitions({packed}, {1, 2, 3}, 2), std::runtime_error);  // repetition 1 empty
  EXPECT_THROW(dcp::summarize_repetitions({packed}, kWarmup, 0), std::invalid_argument);
}

TEST(BenchReport, ModelErrorIsGroupedByTheStepsSpSizes) {
  BenchRun r = opt_run();
  r.steps[1].model_step_s = 1.2, r.steps[1].sp_sizes = "1+2";  // error 0.2
  r.steps[3].model_step_s = 0.9, r.steps[3].sp_sizes = "2";    // error 0.1
  const auto errors = dcp::model_error_by_sp_sizes({r}, kWarmup);
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_EQ(errors[0].sp_sizes, "1+2");
  EXPECT_EQ(errors[0].steps, 1);
  EXPECT_NEAR(errors[0].median_error, 0.2, 1e-12);
  EXPECT_NEAR(errors[1].median_error, 0.1, 1e-12);
}

TEST(BenchReport, OverallMedianPoolsEveryPlannersSteps) {
  // bucket 0.1, 0.2; dcp-opt 0.1, 0.2 -> median 0.15
  EXPECT_NEAR(*dcp::overall_median_prediction_error({bucket_run(), opt_run()}, kWarmup), 0.15, 1e-12);
  BenchRun none = bucket_run();
  for (auto& s : none.steps) s.predicted_step_s.reset();
  EXPECT_FALSE(dcp::overall_median_prediction_error({none}, kWarmup).has_value());
  EXPECT_FALSE(dcp::summarize_bench_run(none, kWarmup).median_prediction_error.has_value());
}

TEST(BenchReport, NoMeasuredStepIsAnError) {
  EXPECT_THROW(dcp::summarize_bench_run(bucket_run(), {1, 2, 3, 4}), std::runtime_error);
}

TEST(BenchReport, TableAndCsvCarryTheNumbers) {
  auto rows = dcp::summarize_bench({bucket_run(), opt_run()}, kWarmup);
  std::string md = dcp::bench_markdown_table(rows);
  EXPECT_NE(md.find("| dcp-opt | 4 (2) | 1000 | 2.000 | n/a | 0.100 | 0.950 | 1.000 | 15.0% | 8.0 | 3.2501 |"),
            std::string::npos)
      << md;
  EXPECT_NE(md.find("| bucket | 4 (2) | 500 | 1.000 | n/a | 0.200 | 1.900 | 2.000 | 15.0% | n/a | 3.2500 |"),
            std::string::npos)
      << md;
  std::string csv = dcp::bench_csv(rows);
  EXPECT_EQ(csv.substr(0, csv.find('\n')),
            "planner,steps,steps_measured,tokens_measured,tokens_per_s,speedup_vs_best_static,model_tokens_per_s,"
            "mean_imbalance,steps_predicted,mean_predicted_step_s,mean_measured_step_s,median_prediction_error_pct,peak_memory_mb,"
            "heldout_bits_per_byte_final");
  EXPECT_NE(csv.find("\nbucket,4,2,2000,500.0,1.0000,,0.2000,2,1.9000,2.0000,15.00,,3.25000\n"), std::string::npos)
      << csv;
  std::string script = dcp::bench_gnuplot_script("out/b.csv", "out/b.png");
  EXPECT_NE(script.find("set output \"out/b.png\""), std::string::npos) << script;
  EXPECT_NE(script.find("\"out/b.csv\" skip 1 using 5:xtic(1)"), std::string::npos) << script;
}

TEST(BenchReport, ReadsARunDirAndNamesBadFiles) {
  fs::path dir = fs::temp_directory_path() / ("dcp_bench_report_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "metrics.jsonl")
      << R"({"step":1,"tokens":100,"step_time_s":0.5,"imbalance":0.1,"predicted_step_s":null,"loss":5})" "\n"
      << R"({"step":2,"tokens":120,"step_time_s":0.4,"imbalance":0.0,"predicted_step_s":0.44,)"
         R"("rank_peak_bytes":[3000000,4000000]})" "\n";
  std::ofstream(dir / "summary.json") << R"({"heldout_bits_per_byte_final":4.5,"threads_per_rank":1,"world_size":2})";
  BenchRun run = dcp::read_bench_run("packed", dir.string());
  ASSERT_EQ(run.steps.size(), 2u);
  EXPECT_FALSE(run.steps[0].predicted_step_s.has_value());
  EXPECT_DOUBLE_EQ(*run.steps[1].predicted_step_s, 0.44);
  EXPECT_DOUBLE_EQ(*run.steps[1].peak_bytes, 4e6);
  EXPECT_DOUBLE_EQ(*run.heldout_bits_per_byte_final, 4.5);
  EXPECT_FALSE(run.peak_bytes.has_value());
  EXPECT_EQ(run.world_size, 2);

  std::ofstream(dir / "metrics.jsonl", std::ios::app) << R"({"step":3})" "\n";
  try {
    dcp::read_bench_run("packed", dir.string());
    ADD_FAILURE() << "a metrics line without tokens must fail";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("metrics.jsonl' line 3"), std::string::npos) << e.what();
  }
  fs::remove(dir / "summary.json");
  fs::remove(dir / "metrics.jsonl");
  try {
    dcp::read_bench_run("packed", dir.string());
    ADD_FAILURE() << "a missing metrics.jsonl must fail";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("metrics.jsonl"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}
