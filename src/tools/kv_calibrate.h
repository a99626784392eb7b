// `dcp kv-calibrate`: the per-model calibration of KV-cache error targets (kv.max_rel_bpb). minimax's
// max_rel_error bounds each block's predicted relative attention-output error; how much bits per byte that costs
// depends on the model downstream, which no cache-only estimate knows. The calibration runs minimax at a grid of
// max_rel_error values on calibration documents (a split disjoint from the evaluation documents, kv_eval_split),
// and for each target keeps the largest max_rel_error whose split-conformal bound of the documents' relative
// increase stays within it (the smallest cache predicted to meet the target on 90% of new documents).
// docs/kv_cache.md "Error targets".
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "tools/kv_eval.h"

namespace dcp {

/// One max_rel_error of the grid, as measured on the calibration documents.
struct KvCalibrationPoint {
  double max_rel_error = 0;
  double mean = 0;         ///< mean relative bpb increase
  double q90 = 0;          ///< its coverage quantile (kv_quantile_with_ci's point; 0.9 by default)
  double bytes_ratio = 0;  ///< kv_bytes_mean over the full cache's
  double bound = 0;        ///< kv_conformal_bound of the documents' increases (+inf: too few documents); the choice's
};

/// Split conformal prediction's bound (Vovk, Gammerman and Shafer 2005; Angelopoulos and Bates 2021, "A Gentle
/// Introduction to Conformal Prediction", section 1): the ceil((n + 1) coverage)-th smallest of the n calibration
/// values, +inf when that rank exceeds n. For a new document exchangeable with the calibration ones,
/// P(its value <= bound) >= coverage, where the plain empirical quantile only reaches that in the limit.
/// Throws std::invalid_argument for coverage outside (0, 1).
double kv_conformal_bound(std::vector<double> values, double coverage);

/// kv_conformal_bound's rank among n values: ceil((n + 1) coverage) (may exceed n).
int64_t kv_conformal_rank(int64_t n, double coverage);

/// The fewest calibration documents whose conformal bound is finite at `coverage` (the smallest n with
/// kv_conformal_rank(n, coverage) <= n, about coverage / (1 - coverage)); coverage in (0, 1).
int64_t kv_conformal_min_documents(double coverage);

/// The calibration of one model: what kv.max_rel_bpb targets map to.
struct KvCalibration {
  std::string policy = "minimax";  ///< the policy spec calibrated (its other options)
  double coverage = 0.9;           ///< the share of documents a target must hold on
  int64_t context = 0, continuation = 0, documents = 0, source_files = 0;
  std::string checkpoint, data_path, split, date;
  /// kv_weights_fingerprint of the model calibrated; "" in files written before 2026-12-06 (not checkable).
  std::string weights;
  /// The calibration documents' source files (kv_source_file of KvEvalDocument::source), sorted, each once; empty in
  /// files written before 2026-12-06 (overlap with evaluated documents not checkable).
  std::vector<std::string> sources;
  std::vector<KvCalibrationPoint> grid;  ///< ascending max_rel_error
  struct Choice {
    double max_rel_bpb = 0;
    double max_rel_error = 0;  ///< 0: no grid point met the target
    double q90 = 0, bytes_ratio = 0;
    double bound = 0;  ///< the chosen point's conformal bound (<= max_rel_bpb); files before 2026-12-06: its q90
  };
  std::vector<Choice> choices;  ///< one per target, ascending
};

struct KvCalibrationOptions {
  KvEvalOptions eval;  ///< context, continuation, max_docs, seed, chunk_tokens (policies and budgets are set here)
  std::string policy = "minimax";
  std::vector<double> grid{0.01, 0.02, 0.04, 0.08, 0.16, 0.32};  ///< max_rel_error values, each > 0
  std::vector<double> targets{0.005, 0.01, 0.02};                 ///< max_rel_bpb values, each > 0
  double coverage = 0.9;
  /// Throws std::invalid_argument naming the value: an empty or non-positive grid or target list, coverage
  /// outside (0, 1), and eval.validate()'s errors for the policy.
  void validate() const;
};

/// Runs minimax at every grid point on `documents` (run_kv_eval: one error-target row per point) and chooses,
/// per target, the largest max_rel_error whose conformal bound (kv_conformal_bound at the coverage) is <= the
/// target (before 2026-12-06: whose empirical quantile was, which held out-of-sample only about half the time
/// at a point near the target). Throws what run_kv_eval throws.
KvCalibration run_kv_calibration(Transformer& model, const std::vector<KvEvalDocument>& documents,
                                 const KvCalibrationOptions& options,
                                 const std::function<void(int64_t, int64_t)>& on_document = {});

/// The calibration as JSON (every field above; "format": "dcp-kv-calibration-1") and back. kv_calibration_from_json
/// throws std::runtime_error naming `what` (the file) and the missing or bad field.
nlohmann::json kv_calibration_json(const KvCalibration& c);
KvCalibration kv_calibration_from_json(const nlohmann::json& j, const std::string& what);

/// A fingerprint of `model`'s weights: FNV-1a 64 over every parameter's name, shape and fp32 bytes, as 16 hex digits
/// (the same weights give the same text whatever the checkpoint folder or compute precision).
std::string kv_weights_fingerprint(Transformer& model);

/// Ties a calibration to the model it is used with. Throws std::runtime_error naming `path`, both fingerprints and
/// the checkpoint the file was made from when c.weights is set and differs from `weights`; returns a warning (""
/// when none) when the file records no fingerprint.
std::string kv_check_calibration_weights(const KvCalibration& c, const std::string& weights, const std::string& path);

/// The source files of `documents` that the calibration also used (sorted, each once): a held-out check must not
/// reuse them. c.sources must be sorted (kv_calibrate and read_kv_calibration sort it).
std::vector<std::string> kv_calibration_overlap(const KvCalibration& c, const std::vector<KvEvalDocument>& documents);

/// Where a checkpoint's calibration lives: CHECKPOINT/kv_calibration.json.
std::string kv_calibration_path(const std::string& checkpoint);
/// Reads the calibration file `path`. Throws std::runtime_error naming the file: missing, not JSON, or a bad field.
KvCalibration read_kv_calibration(const std::string& path);

/// The error-target row for `max_rel_bpb`: the choice of that target (a target the calibration did not list
/// takes the choice of the largest listed target below it, which is conservative). Throws std::invalid_argument
/// naming the target when no listed target is <= it or the one that applies met no grid point.
KvEvalTarget kv_calibrated_target(const KvCalibration& c, double max_rel_bpb);

}  // namespace dcp
