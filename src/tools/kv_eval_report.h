// `dcp kv-eval`'s report: the result as one JSON object, a markdown file, a CSV and a gnuplot script (relative
// bits-per-byte increase against budget, one line per policy). Field meanings: docs/kv_cache.md "`dcp kv-eval`".
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

#include "tools/kv_eval.h"

namespace dcp {

/// Where the result came from, for the report's header.
struct KvEvalReportInfo {
  std::string command;      ///< the exact command line
  std::string checkpoint;   ///< the checkpoint folder
  std::string data_path;    ///< the corpus read
  /// "heldout" (the checkpoint's own held-out samples), "calibration" or "evaluation" (the two halves of its
  /// held-out files, kv_eval_split) or "all" (--data.path)
  std::string split;
  std::string calibration;  ///< where the error targets' calibration came from and what it chose (empty: none)
  KvEvalDocuments documents;  ///< the counts (documents themselves are not reported)
  int64_t threads = 0;      ///< intra-op threads
  int64_t parameters = 0;
  std::string model;        ///< e.g. "d_model 128, 4 layers, 4 heads, bf16"
  std::string date;         ///< UTC
  double load_average_start = -1, load_average_end = -1;  ///< 1-minute load averages; -1 = unknown
};

/// {"checkpoint", "data_path", "split", "calibration", "source_files", "sources" (per document), "paired": [budget,
/// candidate, baseline, documents, diff, diff_ci, wins, bytes_ratio], "context", "continuation", "chunk_tokens",
/// "seed", "bootstrap_resamples", "threads", "documents": {"available", "too_short", "not_chosen", "evaluated",
/// "required_tokens"}, "reference": {"prefill_s", "decode_s"}, "results": [one object per row: policy, budget,
/// max_rel_bpb, max_rel_error, calibrated_q90, calibrated_bytes_ratio, within_target, documents, bpb, bpb_full,
/// rel_bpb_increase, rel_bpb_increase_ci [lo, hi], worst_decile_rel_increase (q90), its _ci, worst_decile_mean,
/// rel_bpb_increase_per_document, attn_rel_err, its _ci, attn_rel_err_per_layer, kv_bytes, kv_bytes_full,
/// kv_bytes_ratio, kv_bytes_mean, kv_bytes_max, kv_bytes_full_mean, kv_bytes_mean_ratio, prefill_s, decode_s,
/// abstained_heads]}. Non-finite numbers are null.
nlohmann::json kv_eval_json(const KvEvalResult& result, const KvEvalReportInfo& info);

/// The markdown report: the command, the setup, the results table (means with 95% intervals), the attention
/// error per layer and what is not measured.
std::string kv_eval_markdown(const KvEvalResult& result, const KvEvalReportInfo& info);

/// One line per row with a header: policy,budget,documents,bpb,bpb_full,rel_bpb_increase,rel_bpb_increase_lo,
/// rel_bpb_increase_hi,worst_decile_rel_increase,worst_decile_lo,worst_decile_hi,attn_rel_err,attn_rel_err_lo,
/// attn_rel_err_hi,kv_bytes,kv_bytes_full,prefill_s,decode_s,abstained_heads,token_accuracy,token_accuracy_full,
/// exact_match,exact_match_full,kv_bytes_mean,kv_bytes_max,kv_bytes_full_mean,kv_bytes_mean_ratio,
/// worst_decile_mean,max_rel_bpb,max_rel_error,within_target.
std::string kv_eval_csv(const KvEvalResult& result);

/// A gnuplot script reading `csv_path` (kv_eval_csv) and drawing `png_path`: rel_bpb_increase (with its
/// interval as error bars) and the worst decile against the measured bytes (kv_bytes_mean over the full cache's),
/// one line per policy of result.options but full, budget rows only.
std::string kv_eval_gnuplot_script(const KvEvalResult& result, const std::string& csv_path,
                                   const std::string& png_path);

/// `dcp kv-eval`'s run and report: stamps `info` with the date and the load, runs run_kv_eval over
/// info.documents (progress on stderr), prints the markdown report (or, with `json`, kv_eval_json) on stdout and,
/// with a non-empty `out` prefix, writes <out>.md, <out>.csv and <out>.png (a warning on stderr without gnuplot).
/// Throws what run_kv_eval throws and std::runtime_error when a file cannot be written.
void run_and_report_kv_eval(Transformer& model, const KvEvalOptions& o, KvEvalReportInfo info, bool json,
                            const std::string& out);

}  // namespace dcp
