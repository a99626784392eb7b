#include "tools/bench_report.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <map>
#include <stdexcept>

#include "util/stats.h"

namespace dcp {
namespace {

using json = nlohmann::json;

std::optional<double> number_or_none(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number()) return std::nullopt;
  return it->get<double>();
}

std::optional<double> max_of(std::optional<double> a, std::optional<double> b) {
  if (!a) return b;
  if (!b) return a;
  return std::max(*a, *b);
}

BenchStep parse_step(const json& j) {
  BenchStep s;
  s.step = j.at("step").get<int64_t>();
  s.tokens = j.at("tokens").get<int64_t>();
  s.step_time_s = j.at("step_time_s").get<double>();
  s.imbalance = j.at("imbalance").get<double>();
  s.predicted_step_s = number_or_none(j, "predicted_step_s");
  s.model_step_s = number_or_none(j, "model_step_s");
  if (auto it = j.find("sp_sizes"); it != j.end() && it->is_array()) {
    std::set<int64_t> sizes;
    for (const auto& v : *it) sizes.insert(v.get<int64_t>());
    for (int64_t v : sizes) s.sp_sizes += (s.sp_sizes.empty() ? "" : "+") + std::to_string(v);
  }
  if (auto it = j.find("rounds"); it != j.end() && it->is_number_integer()) s.rounds = it->get<int64_t>();
  if (auto it = j.find("rank_peak_bytes"); it != j.end() && it->is_array()) {
    for (const auto& b : *it) {
      if (b.is_number()) s.peak_bytes = max_of(s.peak_bytes, b.get<double>());
    }
  }
  return s;
}

// The steps whose numbers count: not a warm-up step, positive time.
std::vector<const BenchStep*> measured_steps(const BenchRun& run, const std::set<int64_t>& warmup_steps) {
  std::vector<const BenchStep*> out;
  for (const auto& s : run.steps) {
    if (!warmup_steps.count(s.step) && s.step_time_s > 0) out.push_back(&s);
  }
  return out;
}

std::string fixed_or_na(const std::optional<double>& v, int digits) {
  return v ? fmt::format("{:.{}f}", *v, digits) : "n/a";
}

std::string fixed_or_empty(const std::optional<double>& v, int digits) {
  return v ? fmt::format("{:.{}f}", *v, digits) : "";
}

std::optional<double> megabytes(const std::optional<double>& bytes) {
  if (!bytes) return std::nullopt;
  return *bytes / 1e6;
}

std::optional<double> percent(const std::optional<double>& share) {
  if (!share) return std::nullopt;
  return 100.0 * *share;
}

}  // namespace

BenchRun read_bench_run(const std::string& planner, const std::string& run_dir) {
  BenchRun run;
  run.planner = planner;
  const std::string metrics_path = run_dir + "/metrics.jsonl";
  std::ifstream metrics(metrics_path);
  if (!metrics) throw std::runtime_error(fmt::format("cannot read '{}'", metrics_path));
  int64_t line_no = 0;
  for (std::string line; std::getline(metrics, line);) {
    ++line_no;
    if (line.empty()) continue;
    try {
      run.steps.push_back(parse_step(json::parse(line)));
    } catch (const json::exception& e) {
      throw std::runtime_error(fmt::format("'{}' line {}: {}", metrics_path, line_no, e.what()));
    }
  }
  const std::string summary_path = run_dir + "/summary.json";
  std::ifstream summary_in(summary_path);
  if (!summary_in) throw std::runtime_error(fmt::format("cannot read '{}'", summary_path));
  try {
    const json summary = json::parse(summary_in);
    run.heldout_bits_per_byte_final = number_or_none(summary, "heldout_bits_per_byte_final");
    run.peak_bytes = number_or_none(summary, "peak_bytes");
    run.threads_per_rank = summary.value("threads_per_rank", int64_t{0});
    run.world_size = summary.value("world_size", int64_t{0});
  } catch (const json::exception& e) {
    throw std::runtime_error(fmt::format("'{}': {}", summary_path, e.what()));
  }
  return run;
}

BenchRow summarize_bench_run(const BenchRun& run, const std::set<int64_t>& warmup_steps) {
  BenchRow row;
  row.planner = run.planner;
  row.steps = static_cast<int64_t>(run.steps.size());
  const auto steps = measured_steps(run, warmup_steps);
  if (steps.empty()) {
    throw std::runtime_error(fmt::format("planner {}: no step left to measure ({} steps, {} warm-up steps)",
                                         run.planner, run.steps.size(), warmup_steps.size()));
  }
  row.steps_measured = static_cast<int64_t>(steps.size());
  double seconds = 0, imbalance = 0;
  double predicted_sum = 0, measured_sum = 0, model_sum = 0;
  bool every_step_modelled = true;
  std::vector<double> errors;
  for (const BenchStep* s : steps) {
    row.tokens += s->tokens;
    seconds += s->step_time_s;
    imbalance += s->imbalance;
    row.peak_bytes = max_of(row.peak_bytes, s->peak_bytes);
    if (s->model_step_s) {
      model_sum += *s->model_step_s;
    } else {
      every_step_modelled = false;
    }
    if (s->predicted_step_s) {
      predicted_sum += *s->predicted_step_s;
      measured_sum += s->step_time_s;
      errors.push_back(std::abs(*s->predicted_step_s / s->step_time_s - 1.0));
    }
  }
  row.tokens_per_s = static_cast<double>(row.tokens) / seconds;
  if (every_step_modelled && model_sum > 0) row.model_tokens_per_s = static_cast<double>(row.tokens) / model_sum;
  row.mean_imbalance = imbalance / static_cast<double>(steps.size());
  row.steps_predicted = static_cast<int64_t>(errors.size());
  if (!errors.empty()) {
    row.mean_predicted_s = predicted_sum / static_cast<double>(errors.size());
    row.mean_measured_s = measured_sum / static_cast<double>(errors.size());
    row.median_prediction_error = median(errors);
  }
  row.peak_bytes = max_of(row.peak_bytes, run.peak_bytes);
  row.heldout_bits_per_byte_final = run.heldout_bits_per_byte_final;
  return row;
}

std::vector<BenchRow> summarize_bench(const std::vector<BenchRun>& runs, const std::set<int64_t>& warmup_steps) {
  std::vector<BenchRow> rows;
  for (const auto& run : runs) rows.push_back(summarize_bench_run(run, warmup_steps));
  double best_static = 0;
  for (const auto& r : rows) {
    if (is_static_planner(r.planner)) best_static = std::max(best_static, r.tokens_per_s);
  }
  if (best_static > 0) {
    for (auto& r : rows) r.speedup_vs_best_static = r.tokens_per_s / best_static;
  }
  std::stable_sort(rows.begin(), rows.end(),
                   [](const BenchRow& a, const BenchRow& b) { return a.tokens_per_s > b.tokens_per_s; });
  return rows;
}

bool is_static_planner(const std::string& planner) {
  return planner == "static" || planner == "bucket" || planner == "packed";
}

std::vector<BenchRepetition> summarize_repetitions(const std::vector<BenchRun>& runs,
                                                   const std::set<int64_t>& warmup_steps, int64_t slice_steps) {
  if (slice_steps < 1) throw std::invalid_argument(fmt::format("bench: slice_steps {} must be >= 1", slice_steps));
  int64_t last_step = 0;
  for (const auto& run : runs)
    for (const auto& s : run.steps) last_step = std::max(last_step, s.step);
  std::vector<BenchRepetition> reps;
  for (int64_t r = 0; r * slice_steps < last_step; ++r) {
    BenchRepetition rep;
    rep.index = r + 1;
    for (const auto& run : runs) {
      int64_t tokens = 0;
      double seconds = 0;
      for (const BenchStep* s : measured_steps(run, warmup_steps)) {
        if (s->step > r * slice_steps && s->step <= (r + 1) * slice_steps) {
          tokens += s->tokens;
          seconds += s->step_time_s;
        }
      }
      if (!(seconds > 0)) {
        throw std::runtime_error(
            fmt::format("planner {}: repetition {} has no measured step (steps {}..{})", run.planner, r + 1,
                        r * slice_steps + 1, (r + 1) * slice_steps));
      }
      rep.tokens_per_s.emplace_back(run.planner, static_cast<double>(tokens) / seconds);
    }
    double best = 0, best_static = 0;
    std::optional<double> dcp_opt, one_round;
    for (const auto& [planner, v] : rep.tokens_per_s) {
      if (v > best) best = v, rep.fastest = planner;
      if (is_static_planner(planner)) best_static = std::max(best_static, v);
      if (planner == "dcp-opt") dcp_opt = v;
      if (planner == "dcp-opt@1") one_round = v;
    }
    if (dcp_opt && best_static > 0) rep.dcp_opt_over_best_static = *dcp_opt / best_static;
    if (dcp_opt && one_round && *one_round > 0) rep.dcp_opt_over_one_round = *dcp_opt / *one_round;
    reps.push_back(std::move(rep));
  }
  return reps;
}

std::string bench_repetition_table(const std::vector<BenchRepetition>& reps) {
  if (reps.empty()) return "";
  std::string head = "| repetition |", rule = "|---|";
  for (const auto& [planner, v] : reps.front().tokens_per_s) {
    head += fmt::format(" {} tokens/s |", planner);
    rule += "---|";
  }
  const bool one_round = std::any_of(reps.begin(), reps.end(), [](const BenchRepetition& r) {
    return r.dcp_opt_over_one_round.has_value();
  });
  std::string out = head + " fastest | dcp-opt / best static |" + (one_round ? " dcp-opt / dcp-opt@1 |" : "") +
                    "\n" + rule + "---|---|" + (one_round ? "---|" : "") + "\n";
  for (const auto& rep : reps) {
    out += fmt::format("| {} |", rep.index);
    for (const auto& entry : rep.tokens_per_s) out += fmt::format(" {:.0f} |", entry.second);
    out += fmt::format(" {} | {} |", rep.fastest, fixed_or_na(rep.dcp_opt_over_best_static, 3));
    if (one_round) out += fmt::format(" {} |", fixed_or_na(rep.dcp_opt_over_one_round, 3));
    out += "\n";
  }
  return out;
}

std::vector<SpPredictionError> model_error_by_sp_sizes(const std::vector<BenchRun>& runs,
                                                       const std::set<int64_t>& warmup_steps) {
  std::map<std::string, std::vector<double>> errors;
  for (const auto& run : runs) {
    for (const BenchStep* s : measured_steps(run, warmup_steps)) {
      if (s->model_step_s) errors[s->sp_sizes].push_back(std::abs(*s->model_step_s / s->step_time_s - 1.0));
    }
  }
  std::vector<SpPredictionError> out;
  for (const auto& [sizes, e] : errors) out.push_back({sizes, static_cast<int64_t>(e.size()), median(e)});
  return out;
}

std::optional<double> overall_median_prediction_error(const std::vector<BenchRun>& runs,
                                                      const std::set<int64_t>& warmup_steps) {
  std::vector<double> errors;
  for (const auto& run : runs) {
    for (const BenchStep* s : measured_steps(run, warmup_steps)) {
      if (s->predicted_step_s) errors.push_back(std::abs(*s->predicted_step_s / s->step_time_s - 1.0));
    }
  }
  if (errors.empty()) return std::nullopt;
  return median(errors);
}

std::string bench_markdown_table(const std::vector<BenchRow>& rows) {
  std::string out =
      "| planner | steps (measured) | tokens/s | speedup vs best static | model-predicted tokens/s | mean imbalance | "
      "mean predicted step s | mean measured step s | median prediction error | peak memory MB | held-out "
      "bits/byte |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& r : rows) {
    out += fmt::format("| {} | {} ({}) | {:.0f} | {} | {} | {:.3f} | {} | {} | {} | {} | {} |\n", r.planner,
                       r.steps, r.steps_measured, r.tokens_per_s, fixed_or_na(r.speedup_vs_best_static, 3),
                       fixed_or_na(r.model_tokens_per_s, 0), r.mean_imbalance,
                       fixed_or_na(r.mean_predicted_s, 3), fixed_or_na(r.mean_measured_s, 3),
                       r.median_prediction_error ? fmt::format("{:.1f}%", 100.0 * *r.median_prediction_error) : "n/a",
                       fixed_or_na(megabytes(r.peak_bytes), 1), fixed_or_na(r.heldout_bits_per_byte_final, 4));
  }
  return out;
}

std::string bench_csv(const std::vector<BenchRow>& rows) {
  std::string out =
      "planner,steps,steps_measured,tokens_measured,tokens_per_s,speedup_vs_best_static,model_tokens_per_s,"
      "mean_imbalance,steps_predicted,"
      "mean_predicted_step_s,mean_measured_step_s,median_prediction_error_pct,peak_memory_mb,"
      "heldout_bits_per_byte_final\n";
  for (const auto& r : rows) {
    out += fmt::format("{},{},{},{},{:.1f},{},{},{:.4f},{},{},{},{},{},{}\n", r.planner, r.steps, r.steps_measured,
                       r.tokens, r.tokens_per_s, fixed_or_empty(r.speedup_vs_best_static, 4),
                       fixed_or_empty(r.model_tokens_per_s, 1), r.mean_imbalance,
                       r.steps_predicted, fixed_or_empty(r.mean_predicted_s, 4), fixed_or_empty(r.mean_measured_s, 4),
                       fixed_or_empty(percent(r.median_prediction_error), 2),
                       fixed_or_empty(megabytes(r.peak_bytes), 1), fixed_or_empty(r.heldout_bits_per_byte_final, 5));
  }
  return out;
}

std::string gnuplot_quoted(const std::string& s) {
  std::string q = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') q += '\\';
    q += c;
  }
  return q + "\"";
}

std::string bench_gnuplot_script(const std::string& csv_path, const std::string& png_path) {
  // Columns as bench_csv writes them: 1 planner, 5 tokens_per_s, 9 mean_predicted_step_s, 10 mean_measured_step_s.
  return fmt::format(
      "set terminal pngcairo noenhanced size 1200,480 font \",10\"\n"
      "set output {png}\n"
      "set datafile separator \",\"\n"
      "set style data histograms\n"
      "set style fill solid 0.8 border -1\n"
      "set boxwidth 0.8\n"
      "set grid ytics\n"
      "set xtics rotate by -30\n"
      "set yrange [0:*]\n"
      "set offsets 0, 0, graph 0.12, 0\n"  // headroom above the tallest bar
      "set key top right horizontal\n"
      "set multiplot layout 1,2\n"
      "set title \"Measured throughput (tokens/s)\"\n"
      "set style histogram clustered gap 1\n"
      "plot {csv} skip 1 using 5:xtic(1) title \"tokens/s\" linecolor rgb \"#4477aa\"\n"
      "set title \"Step time: predicted (calibrated) vs measured, mean s\"\n"
      "set style histogram clustered gap 1\n"
      "plot {csv} skip 1 using 10:xtic(1) title \"predicted\" linecolor rgb \"#ee7733\", \\\n"
      "     '' skip 1 using 11 title \"measured\" linecolor rgb \"#4477aa\"\n"
      "unset multiplot\n",
      fmt::arg("png", gnuplot_quoted(png_path)), fmt::arg("csv", gnuplot_quoted(csv_path)));
}

}  // namespace dcp
