// `dcp kv-eval`'s report writers: JSON, markdown, CSV and the gnuplot script.
#include "tools/kv_eval_report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <sstream>

#include "dcp/kv_policies.h"
#include "tools/bench_common.h"
#include "tools/bench_report.h"  // gnuplot_quoted

namespace dcp {
namespace {

nlohmann::json number(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); }

nlohmann::json interval(const KvEvalStat& s) { return nlohmann::json::array({number(s.ci[0]), number(s.ci[1])}); }

// A relative change as a percentage with its interval: "+1.23% [0.98, 1.50]".
std::string percent(const KvEvalStat& s) {
  return fmt::format("{:+.2f}% [{:+.2f}, {:+.2f}]", 100 * s.value, 100 * s.ci[0], 100 * s.ci[1]);
}

// A relative change with an interval whose ends may be infinite (an order statistic beyond the sample).
std::string percent_open(const KvEvalStat& s) {
  auto end = [](double v) { return std::isfinite(v) ? fmt::format("{:+.2f}", 100 * v) : std::string(v > 0 ? "+inf" : "-inf"); };
  return fmt::format("{:+.2f}% [{}, {}]", 100 * s.value, end(s.ci[0]), end(s.ci[1]));
}

// A row's name in tables: the policy, and for an error-target row its target.
std::string row_label(const KvEvalRow& row) {
  return row.target ? fmt::format("{} @ max_rel_bpb {:g}", row.policy, row.target->max_rel_bpb) : row.policy;
}

double bytes_ratio(const KvEvalRow& row) { return row.kv_bytes_mean / row.kv_bytes_full_mean; }

std::string csv_number(double v) { return std::isfinite(v) ? fmt::format("{:.9g}", v) : std::string(); }

// A layer-major [layers x heads] vector as nested arrays, one per layer.
nlohmann::json per_layer(const std::vector<double>& flat, size_t layers) {
  nlohmann::json out = nlohmann::json::array();
  const size_t heads = layers == 0 ? 0 : flat.size() / layers;
  for (size_t l = 0; l < layers; ++l) {
    nlohmann::json row = nlohmann::json::array();
    for (size_t h = 0; h < heads; ++h) row.push_back(number(flat[l * heads + h]));
    out.push_back(row);
  }
  return out;
}

nlohmann::json ablation_json(const std::vector<KvHeadAblation>& heads) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& a : heads) {
    out.push_back({{"layer", a.layer},
                   {"head", a.head},
                   {"token_accuracy", number(a.token_accuracy)},
                   {"exact_match", number(a.exact_match)},
                   {"rel_bpb_increase", number(a.rel_bpb_increase)}});
  }
  return out;
}

std::string split_text(const std::string& split) {
  if (split == "heldout") return "the checkpoint's held-out split";
  if (split == "calibration") return "the calibration half of the documents' source files";
  if (split == "evaluation") return "the evaluation half of the documents' source files (disjoint from the calibration half)";
  return "every sample";
}

size_t layers_of(const KvEvalResult& r) {
  return r.rows.empty() ? 0 : r.rows.front().attn_rel_err_per_layer.size();
}

// Per (layer, head): what cutting the head alone did (--head-ablation) and how often each abstaining row kept it
// exact. Empty when there is neither.
std::string heads_table(const KvEvalResult& r) {
  const size_t layers = layers_of(r);
  std::vector<const KvEvalRow*> abstaining;
  for (const auto& row : r.rows) {
    if (row.abstained_heads > 0) abstaining.push_back(&row);
  }
  if (layers == 0 || (r.head_ablation.empty() && abstaining.empty())) return {};
  const size_t heads = r.rows.front().abstained_by_head.size() / layers;
  const bool cut = !r.head_ablation.empty();
  std::ostringstream md;
  md << "Heads:";
  if (cut) {
    md << fmt::format(" `cut` = the run with only this head's cache cut, right after prefill, to its first {} and "
                      "newest {} entries (every other head full): top-1, exact and the relative bpb increase over "
                      "the full cache. A head whose cut costs a lot reads the distant context (a retrieval head);",
                      kKvAblationSinks, kKvAblationRecent);
  }
  if (!abstaining.empty()) md << " per policy and budget that abstained, the fraction of documents on which it kept the head exact;";
  md << "\n\n| layer | head |" << (cut ? " cut top-1 | cut exact | cut rel bpb |" : "");
  for (const KvEvalRow* row : abstaining) md << fmt::format(" {} {:g} |", row->policy, row->budget);
  md << "\n|---|---|" << (cut ? "---|---|---|" : "");
  for (size_t i = 0; i < abstaining.size(); ++i) md << "---|";
  md << "\n";
  for (size_t i = 0; i < layers * heads; ++i) {
    md << fmt::format("| {} | {} |", i / heads, i % heads);
    if (cut) {
      const KvHeadAblation& a = r.head_ablation[i];
      md << fmt::format(" {:.3f} | {:.3f} | {:+.1f}% |", a.token_accuracy, a.exact_match, 100 * a.rel_bpb_increase);
    }
    for (const KvEvalRow* row : abstaining) md << fmt::format(" {:.2f} |", row->abstained_by_head[i]);
    md << "\n";
  }
  return md.str() + "\n";
}

}  // namespace

nlohmann::json kv_eval_json(const KvEvalResult& r, const KvEvalReportInfo& info) {
  const KvEvalOptions& o = r.options;
  nlohmann::json results = nlohmann::json::array();
  for (const auto& row : r.rows) {
    nlohmann::json layers = nlohmann::json::array();
    for (double e : row.attn_rel_err_per_layer) layers.push_back(number(e));
    nlohmann::json per_doc = nlohmann::json::array();
    for (double v : row.rel_per_document) per_doc.push_back(number(v));
    // A budget row's target fields are 0.
    const KvEvalTarget t = row.target.value_or(KvEvalTarget{});
    results.push_back({{"policy", row.policy},
                       {"budget", row.budget},
                       {"max_rel_bpb", number(t.max_rel_bpb)},
                       {"max_rel_error", number(t.max_rel_error)},
                       {"calibrated_q90", number(t.calibrated_q90)},
                       {"calibrated_bound", number(t.calibrated_bound)},
                       {"calibrated_bytes_ratio", number(t.calibrated_bytes_ratio)},
                       {"within_target", number(row.within_target)},
                       {"documents", row.documents},
                       {"bpb", number(row.bpb)},
                       {"bpb_full", number(row.bpb_full)},
                       {"token_accuracy", number(row.token_accuracy)},
                       {"token_accuracy_full", number(row.token_accuracy_full)},
                       {"exact_match", number(row.exact_match)},
                       {"exact_match_full", number(row.exact_match_full)},
                       {"rel_bpb_increase", number(row.rel_bpb_increase.value)},
                       {"rel_bpb_increase_ci", interval(row.rel_bpb_increase)},
                       {"worst_decile_rel_increase", number(row.worst_decile_rel_increase.value)},
                       {"worst_decile_rel_increase_ci", interval(row.worst_decile_rel_increase)},
                       {"worst_decile_mean", number(row.worst_decile_mean)},
                       {"rel_bpb_increase_per_document", per_doc},
                       {"attn_rel_err", number(row.attn_rel_err.value)},
                       {"attn_rel_err_ci", interval(row.attn_rel_err)},
                       {"attn_rel_err_per_layer", layers},
                       {"kv_bytes", number(row.kv_bytes)},
                       {"kv_bytes_full", number(row.kv_bytes_full)},
                       {"kv_bytes_ratio", number(row.kv_bytes / row.kv_bytes_full)},
                       {"kv_bytes_mean", number(row.kv_bytes_mean)},
                       {"kv_bytes_max", number(row.kv_bytes_max)},
                       {"kv_bytes_full_mean", number(row.kv_bytes_full_mean)},
                       {"kv_bytes_mean_ratio", number(bytes_ratio(row))},
                       {"prefill_s", number(row.prefill_s)},
                       {"decode_s", number(row.decode_s)},
                       {"abstained_heads", number(row.abstained_heads)},
                       {"abstained_by_head", per_layer(row.abstained_by_head, layers_of(r))}});
  }
  nlohmann::json paired = nlohmann::json::array();
  for (const auto& p : r.paired) {
    paired.push_back({{"budget", p.budget},
                      {"candidate", p.candidate},
                      {"baseline", p.baseline},
                      {"documents", p.documents},
                      {"diff", number(p.diff.value)},
                      {"diff_ci", interval(p.diff)},
                      {"wins", number(p.wins)},
                      {"bytes_ratio", number(p.bytes_ratio)}});
  }
  return {{"checkpoint", info.checkpoint},
          {"data_path", info.data_path},
          {"split", info.split},
          {"calibration", info.calibration},
          {"source_files", r.source_files},
          {"sources", r.sources},
          {"paired", paired},
          {"context", o.context},
          {"continuation", o.continuation},
          {"chunk_tokens", o.chunk_tokens},
          {"chunk_pairs", o.chunk_pairs},
          {"seed", o.seed},
          {"bootstrap_resamples", o.bootstrap_resamples},
          {"threads", info.threads},
          {"documents",
           {{"available", info.documents.available},
            {"too_short", info.documents.too_short},
            {"not_chosen", info.documents.not_chosen},
            {"evaluated", static_cast<int64_t>(info.documents.documents.size())},
            {"required_tokens", info.documents.required_tokens}}},
          {"reference", {{"prefill_s", number(r.full_prefill_s)}, {"decode_s", number(r.full_decode_s)}}},
          {"head_ablation", ablation_json(r.head_ablation)},
          {"results", results}};
}

std::string kv_eval_markdown(const KvEvalResult& r, const KvEvalReportInfo& info) {
  const KvEvalOptions& o = r.options;
  const KvEvalDocuments& d = info.documents;
  std::ostringstream md;
  md << "# dcp kv-eval: KV-cache policies on a trained model\n\n";
  md << "```sh\n" << info.command << "\n```\n\n";
  md << fmt::format(
      "Date: {} UTC. Checkpoint `{}`: {} parameters, {}. Documents: `{}` ({}), {} samples, {} shorter than the {} "
      "tokens needed (context {} + continuation {} + 1, BOS included) skipped, {} long enough but beyond "
      "--max-docs, **{} evaluated** (chosen with seed {}) from {} source files. Prefill chunk {} tokens{}, "
      "intra-op threads: {}, 1-minute load average {:.2f} at the start, {:.2f} at the end.\n\n",
      info.date, info.checkpoint, info.parameters, info.model, info.data_path, split_text(info.split), d.available,
      d.too_short, d.required_tokens, o.context, o.continuation, d.not_chosen, d.documents.size(), o.seed,
      r.source_files, o.chunk_tokens,
      o.chunk_pairs > 0 ? fmt::format(" (at most {} query-key pairs, kv.chunk_pairs)", o.chunk_pairs) : std::string(),
      info.threads, info.load_average_start, info.load_average_end);
  if (!info.calibration.empty()) md << "Calibration: " << info.calibration << "\n\n";
  md << fmt::format(
      "Per document the first {} tokens are prefilled with the policy, the next {} teacher-forced one decode() "
      "at a time (the policy compresses while decoding as it does in generation), and their true next bytes "
      "scored. `top-1` = the fraction of those tokens that are the argmax of their logits (greedy decoding would "
      "emit them), `exact` = the fraction of documents where all are (retrieval accuracy when the continuation is "
      "the answer). `rel bpb increase` = (bpb - bpb_full) / bpb_full per document, then the mean, with a 95% "
      "bootstrap interval over source files (every document of a file resampled together; {} resamples, seed "
      "{}); `worst decile` = the 90th percentile of the documents' increases with its distribution-free "
      "order-statistic 95% interval (+inf: too few documents to bound it), and the mean of the worst 10%. `attn "
      "rel err`: per layer, head and true future query (the full run's continuation queries, after rotary), "
      "||o_c - o_f|| / ||o_f|| of the attention output over the cache right after prefill, policy vs full, "
      "averaged. `bytes`: what each scored token's attention read (the cache before its decode() plus its own "
      "entries), mean and maximum over the continuation, over the full cache's mean: every comparison is at these "
      "measured bytes, not at the nominal budget. Times are wall seconds per document. Field definitions and what "
      "is not measured: docs/kv_cache.md, \"`dcp kv-eval`\".\n\n",
      o.context, o.continuation, o.bootstrap_resamples, o.seed);
  md << "| policy | budget | bytes mean / full (max) | bpb | bpb full | top-1 (full) | exact (full) | rel bpb increase "
        "[95% CI] | worst decile q90 [95% CI] | worst 10% mean | attn rel err [95% CI] | prefill s | decode s | "
        "abstained heads |\n";
  md << "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& row : r.rows) {
    md << fmt::format("| {} | {} | {:.3f} ({:.3f}) | {:.4f} | {:.4f} | {:.3f} ({:.3f}) | {:.3f} ({:.3f}) | {} | {} | "
                      "{:+.2f}% | {:.4f} [{:.4f}, {:.4f}] | {:.3f} | {:.3f} | {:.1f} |\n",
                      row_label(row), row.target ? std::string("-") : fmt::format("{:g}", row.budget),
                      bytes_ratio(row), row.kv_bytes_max / row.kv_bytes_full_mean, row.bpb, row.bpb_full,
                      row.token_accuracy, row.token_accuracy_full, row.exact_match, row.exact_match_full,
                      percent(row.rel_bpb_increase), percent_open(row.worst_decile_rel_increase),
                      100 * row.worst_decile_mean, row.attn_rel_err.value, row.attn_rel_err.ci[0],
                      row.attn_rel_err.ci[1], row.prefill_s, row.decode_s, row.abstained_heads);
  }
  if (!r.paired.empty()) {
    md << "\nPaired per document: d = increase(candidate) - increase(baseline) on the same document (negative: "
          "the candidate is better), its mean with a 95% bootstrap interval over source files, the share of "
          "documents the candidate wins, and the candidate's measured bytes over the baseline's.\n\n";
    md << "| budget | candidate | baseline | mean d [95% CI] | wins | bytes ratio |\n|---|---|---|---|---|---|\n";
    for (const auto& p : r.paired) {
      md << fmt::format("| {:g} | {} | {} | {} | {:.2f} | {:.3f} |\n", p.budget, p.candidate, p.baseline,
                        percent(p.diff), p.wins, p.bytes_ratio);
    }
  }
  bool targets = false;
  for (const auto& row : r.rows) targets = targets || row.target.has_value();
  if (targets) {
    md << "\nError targets: the calibration's prediction at the chosen max_rel_error (on its own documents: the "
          "increase's quantile at the calibration's coverage, the conformal bound the choice was made on, and the "
          "bytes held) against what these documents measured.\n\n";
    md << "| target | max_rel_error | calibrated quantile | conformal bound | measured q90 [95% CI] | measured mean | "
          "within target | bytes predicted | bytes measured |\n|---|---|---|---|---|---|---|---|---|\n";
    for (const auto& row : r.rows) {
      if (!row.target) continue;
      const KvEvalTarget& t = *row.target;
      md << fmt::format("| {:g} | {:g} | {:+.2f}% | {:+.2f}% | {} | {:+.2f}% | {:.1f}% | {:.3f} | {:.3f} |\n",
                        t.max_rel_bpb, t.max_rel_error, 100 * t.calibrated_q90, 100 * t.calibrated_bound,
                        percent_open(row.worst_decile_rel_increase),
                        100 * row.rel_bpb_increase.value, 100 * row.within_target, t.calibrated_bytes_ratio,
                        bytes_ratio(row));
    }
  }
  md << fmt::format("\nReference run (full cache, recording the continuation's queries): prefill {:.3f} s, decode "
                    "{:.3f} s per document. `full` takes no budget: it ran once per document and its row repeats "
                    "at every budget.\n\n",
                    r.full_prefill_s, r.full_decode_s);
  const size_t layers = layers_of(r);
  md << "Attention relative error per layer:\n\n| policy | budget |";
  for (size_t l = 0; l < layers; ++l) md << " layer " << l << " |";
  md << "\n|---|---|";
  for (size_t l = 0; l < layers; ++l) md << "---|";
  md << "\n";
  for (const auto& row : r.rows) {
    md << fmt::format("| {} | {} |", row_label(row), row.target ? std::string("-") : fmt::format("{:g}", row.budget));
    for (double e : row.attn_rel_err_per_layer) md << fmt::format(" {:.4f} |", e);
    md << "\n";
  }
  md << "\n" << heads_table(r);
  md << "Not measured: contexts beyond the trained window, the query-agnostic "
        "protocol, peak memory during compression, and GPU timings.\n";
  return md.str();
}

std::string kv_eval_csv(const KvEvalResult& r) {
  std::string csv =
      "policy,budget,documents,bpb,bpb_full,rel_bpb_increase,rel_bpb_increase_lo,rel_bpb_increase_hi,"
      "worst_decile_rel_increase,worst_decile_lo,worst_decile_hi,attn_rel_err,attn_rel_err_lo,attn_rel_err_hi,"
      "kv_bytes,kv_bytes_full,prefill_s,decode_s,abstained_heads,token_accuracy,token_accuracy_full,exact_match,"
      "exact_match_full,kv_bytes_mean,kv_bytes_max,kv_bytes_full_mean,kv_bytes_mean_ratio,worst_decile_mean,"
      "max_rel_bpb,max_rel_error,within_target\n";
  for (const auto& row : r.rows) {
    const std::vector<std::string> f = {
        row.policy,
        csv_number(row.budget),
        std::to_string(row.documents),
        csv_number(row.bpb),
        csv_number(row.bpb_full),
        csv_number(row.rel_bpb_increase.value),
        csv_number(row.rel_bpb_increase.ci[0]),
        csv_number(row.rel_bpb_increase.ci[1]),
        csv_number(row.worst_decile_rel_increase.value),
        csv_number(row.worst_decile_rel_increase.ci[0]),
        csv_number(row.worst_decile_rel_increase.ci[1]),
        csv_number(row.attn_rel_err.value),
        csv_number(row.attn_rel_err.ci[0]),
        csv_number(row.attn_rel_err.ci[1]),
        csv_number(row.kv_bytes),
        csv_number(row.kv_bytes_full),
        csv_number(row.prefill_s),
        csv_number(row.decode_s),
        csv_number(row.abstained_heads),
        csv_number(row.token_accuracy),
        csv_number(row.token_accuracy_full),
        csv_number(row.exact_match),
        csv_number(row.exact_match_full),
        csv_number(row.kv_bytes_mean),
        csv_number(row.kv_bytes_max),
        csv_number(row.kv_bytes_full_mean),
        csv_number(bytes_ratio(row)),
        csv_number(row.worst_decile_mean),
        csv_number(row.target ? row.target->max_rel_bpb : 0),
        csv_number(row.target ? row.target->max_rel_error : 0),
        csv_number(row.within_target)};
    csv += fmt::format("{}\n", fmt::join(f, ","));
  }
  return csv;
}

std::string kv_eval_gnuplot_script(const KvEvalResult& r, const std::string& csv_path, const std::string& png_path) {
  // CSV columns: 1 policy, 6-8 rel_bpb_increase and its interval, 9 worst decile (q90), 27 the measured bytes
  // over the full cache's (the x axis: equal memory, not the nominal budget), 29 max_rel_bpb (0 on budget rows).
  // A policy's budget rows are picked by comparing column 1 (other rows are undefined points, which gnuplot
  // skips); full is left out (it sits at 1).
  std::vector<std::string> shown;
  for (const auto& p : r.options.policies) {
    if (parse_kv_policy_spec(p).name != "full") shown.push_back(p);
  }
  std::string mean_plot, worst_plot;
  for (size_t i = 0; i < shown.size(); ++i) {
    const std::string& p = shown[i];
    const std::string sep = i + 1 < shown.size() ? ", \\\n     " : "\n";
    mean_plot += fmt::format("{csv} skip 1 using 27:(strcol(1) eq {q} && $29 == 0 ? 100*$6 : 1/0):(100*$7):(100*$8) "
                             "with yerrorlines title {q}{sep}",
                             fmt::arg("csv", gnuplot_quoted(csv_path)), fmt::arg("sep", sep),
                             fmt::arg("q", gnuplot_quoted(p)));
    worst_plot += fmt::format("{csv} skip 1 using 27:(strcol(1) eq {q} && $29 == 0 ? 100*$9 : 1/0) with linespoints "
                              "title {q}{sep}",
                              fmt::arg("csv", gnuplot_quoted(csv_path)), fmt::arg("sep", sep),
                              fmt::arg("q", gnuplot_quoted(p)));
  }
  if (shown.empty()) {
    mean_plot = worst_plot = "NaN notitle\n";
  }
  return fmt::format(
      "set terminal pngcairo noenhanced size 1200,480 font \",10\"\n"
      "set output {png}\n"
      "set datafile separator \",\"\n"
      "set logscale x\n"
      "set grid\n"
      "set xlabel \"measured bytes over the full cache's (mean over the scored continuation)\"\n"
      "set key top right\n"
      "set multiplot layout 1,2\n"
      "set title \"Relative bits-per-byte increase over the full cache, mean (95% CI), %\"\n"
      "plot {mean}"
      "set title \"Worst decile of documents (90th percentile), %\"\n"
      "plot {worst}"
      "unset multiplot\n",
      fmt::arg("png", gnuplot_quoted(png_path)), fmt::arg("mean", mean_plot), fmt::arg("worst", worst_plot));
}

void run_and_report_kv_eval(Transformer& model, const KvEvalOptions& o, KvEvalReportInfo info, bool json,
                            const std::string& out) {
  info.date = utc_now("%Y-%m-%d %H:%M");
  info.load_average_start = load_average_1min();
  const KvEvalResult result = run_kv_eval(model, info.documents.documents, o, [](int64_t done, int64_t total) {
    fmt::print(stderr, "kv-eval: document {}/{} done\n", done, total);
  });
  info.load_average_end = load_average_1min();

  if (json) {
    fmt::print("{}\n", kv_eval_json(result, info).dump(2));
  } else {
    fmt::print("{}", kv_eval_markdown(result, info));
  }
  std::fflush(stdout);  // before the messages on stderr, so that one log of both never splits the report
  if (!out.empty()) {
    const std::string csv = out + ".csv", png = out + ".png";
    write_text(out + ".md", kv_eval_markdown(result, info));
    write_text(csv, kv_eval_csv(result));
    // The figure plots the budget rows of the policies other than full: with none, there is nothing to draw.
    const bool plottable = std::any_of(result.options.policies.begin(), result.options.policies.end(),
                                       [](const std::string& p) { return parse_kv_policy_spec(p).name != "full"; });
    const bool drawn = plottable && gnuplot_available();
    if (!plottable) {
      fmt::print(stderr, "kv-eval: {} not drawn: no policy but full has budget rows to plot\n", png);
    } else if (drawn) {
      run_gnuplot(kv_eval_gnuplot_script(result, csv, png), out + ".gnuplot", out + ".gnuplot.log");
    } else {
      fmt::print(stderr, "kv-eval: warning: gnuplot not found in PATH, {} not drawn (scripts/install-deps.sh "
                         "installs gnuplot-nox)\n", png);
    }
    fmt::print(stderr, "kv-eval: wrote {}.md, {}{}\n", out, csv, drawn ? ", " + png : "");
  }
}

}  // namespace dcp
