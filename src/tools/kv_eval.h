// `dcp kv-eval`: what KV-cache compression policies cost a trained softmax model on real documents
// (../shared/specs/kv-cache-compression.md 7.3, task fidelity, and 7.2, operator fidelity on recorded caches).
// Per document: the first `context` tokens are prefilled through a DecodeSession with the policy, the next
// `continuation` tokens are teacher-forced one decode() at a time (the policy compresses as it would while
// generating), and the log-probabilities of the true next bytes give bits per byte, against the same run with
// the full cache. The attention error compares, per layer, the attention output over the prefilled context of
// the full run's true future queries, with the policy's cache against the full one. docs/kv_cache.md
// "`dcp kv-eval`" describes every field and what is not measured.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dcp/data.h"
#include "dcp/kv_cache.h"
#include "dcp/kv_policies.h"
#include "dcp/kv_policy.h"
#include "dcp/model.h"

namespace dcp {

/// An error-target row (`kv.max_rel_bpb`, docs/kv_cache.md "Error targets"): minimax with max_rel_error set by
/// the per-model calibration (`dcp kv-calibrate`) for the target relative bits-per-byte increase.
struct KvEvalTarget {
  double max_rel_bpb = 0;    ///< the target, > 0
  double max_rel_error = 0;  ///< minimax's per-block relative error the calibration chose for it, > 0
  /// What the calibration measured at that max_rel_error on its own documents: the 90th percentile of the
  /// relative increase (the prediction for held-out documents) and the bytes held over the full cache's.
  double calibrated_q90 = 0, calibrated_bytes_ratio = 0;
  std::string policy = "minimax";  ///< the spec the target's option is added to (its other options)
  double calibrated_bound = 0;  ///< the choice's conformal bound (what it was chosen on; its q90 for older files)
};

/// The first element of `v` equal to an earlier one, or v.end() (repeated list items are usage errors).
template <class T>
typename std::vector<T>::const_iterator kv_first_repeat(const std::vector<T>& v) {
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (std::find(v.begin(), it, *it) != it) return it;
  }
  return v.end();
}

/// The first of the options an error target sets itself (budget, max_tokens, max_rel_error) that `options` gives,
/// or nullptr: what kv-eval, kv-calibrate and generate refuse beside a target.
const char* kv_target_set_option(const KvPolicyOptions& options);

/// The policy of an error-target row: t.policy (a spec, parse_kv_policy_spec) with max_rel_error =
/// t.max_rel_error and budget 1. Throws std::invalid_argument when the spec sets budget, max_tokens or
/// max_rel_error itself, or when make_kv_policy refuses it (e.g. minimax:max_keep_fraction below 1: screening is a
/// budget-mode option).
std::shared_ptr<KvPolicy> kv_eval_target_policy(const KvEvalTarget& t);

/// Checks that the policy a calibration file names (`path`, read into t by kv_calibrated_target) makes an
/// error-target policy (kv_eval_target_policy). Throws std::runtime_error naming the file, its policy field and
/// why (a bad file: exit 1 in dcp kv-eval and dcp generate).
void kv_check_calibration_policy(const KvEvalTarget& t, const std::string& path);

/// What one evaluation runs.
struct KvEvalOptions {
  /// Policy specs, "NAME" or "NAME:KEY=VALUE:..." (parse_kv_policy_spec; the budget comes from `budgets`);
  /// `full` takes no budget (one run, every budget row)
  std::vector<std::string> policies;
  std::vector<double> budgets;        ///< the policies' `budget` option, each in (0, 1]
  int64_t context = 1024;             ///< tokens prefilled (BOS and the first context - 1 bytes), >= 1
  int64_t continuation = 128;         ///< tokens teacher-forced and scored after the context, >= 1
  int64_t max_docs = 32;              ///< documents evaluated at most (a seeded choice among the long enough), >= 1
  uint64_t seed = 0;                  ///< the choice of documents and the bootstrap resamples
  int64_t chunk_tokens = 512;         ///< prefill chunk of every DecodeSession, >= 1
  int64_t chunk_pairs = 0;            ///< its attention bound (kv.chunk_pairs, prefill_chunk_length), >= 0
  int64_t bootstrap_resamples = 1000; ///< resamples over documents for the 95% intervals, >= 1
  /// Also run every document once per (layer, head) with only that head cut, right after prefill, to its first
  /// kKvAblationSinks and newest kKvAblationRecent entries (every other head full): which heads the
  /// continuation needs the distant context of (KvEvalResult::head_ablation). layers x heads more runs.
  bool head_ablation = false;
  /// Error-target rows, run after the budget rows (one run each, budget 1).
  std::vector<KvEvalTarget> targets;
  /// The policy whose per-document increases are compared, paired, with every other policy's at the same
  /// budget (KvEvalResult::paired); empty = "minimax" when it is among `policies`, else none.
  std::string paired_against;
  /// Throws std::invalid_argument naming the field and its value: no policy, no budget, a budget outside (0, 1]
  /// or NaN, context, continuation, max_docs, chunk_tokens or bootstrap_resamples < 1, chunk_pairs < 0; and for a policy spec
  /// that does not build (make_kv_policy's and parse_kv_policy_spec's messages) or sets budget or max_tokens, a
  /// policy or budget given twice, and head_ablation with context <= kKvAblationSinks + kKvAblationRecent.
  void validate() const;
};

/// One document to evaluate: BOS then its bytes, as the trainer feeds a sample (model inputs).
struct KvEvalDocument {
  std::string source;           ///< the corpus sample's source ("path#chunk")
  std::vector<int64_t> tokens;  ///< BOS, then the sample's bytes (ids < 256)
};

/// The documents chosen from `ids` (samples of `corpus`).
struct KvEvalDocuments {
  std::vector<KvEvalDocument> documents;
  int64_t available = 0;   ///< samples in `ids`
  int64_t too_short = 0;   ///< of them with fewer than required_tokens tokens (BOS + bytes): skipped
  int64_t not_chosen = 0;  ///< long enough but beyond max_docs
  int64_t required_tokens = 0;  ///< context + continuation + 1: the prefill, the decoded tokens and the last target
};

/// Where a kv-eval or kv-calibrate run takes its documents from (the commands' --data.path and --split).
struct KvEvalSource {
  std::string data_path;  ///< the corpus read
  /// "heldout" (the checkpoint's held-out split), "all" (every sample of --data.path), or a half of either by
  /// source file: "calibration" or "evaluation" (kv_eval_split; disjoint)
  std::string split;
  std::vector<int64_t> ids;  ///< the samples of that split
};

/// The samples a run may use: without `data_path`, the held-out samples of the checkpoint's corpus (`data`, its
/// data.* config, so documents are cut at its max_seq_len as in training); with it, every sample of that path
/// (format detected, the checkpoint's max_seq_len and glob). `half` "" keeps them all, "calibration" or
/// "evaluation" one half by source file. `corpus` receives the loaded corpus. Throws std::invalid_argument for
/// another half, and what Corpus::load throws.
KvEvalSource kv_eval_source(const DataConfig& data, const std::string& data_path, const std::string& half,
                            Corpus& corpus);

/// Picks the samples of `ids` with at least context + continuation + 1 tokens (BOS + bytes), shuffled with
/// `seed`, the first max_docs of them. Throws std::invalid_argument when none is long enough, saying how many
/// samples there are, the longest one and the tokens needed.
KvEvalDocuments choose_kv_eval_documents(const Corpus& corpus, const std::vector<int64_t>& ids,
                                         const KvEvalOptions& options);

/// A statistic over documents and its 95% interval.
struct KvEvalStat {
  double value = 0;
  std::array<double, 2> ci{0, 0};  ///< [lo, hi]: see where each is computed
};

/// One (policy, budget) over the documents. Per-document quantities are averaged over documents.
struct KvEvalRow {
  std::string policy;
  double budget = 1;
  /// An error-target row's target (its max_rel_bpb, calibrated max_rel_error and the calibration's prediction;
  /// its budget is then 1); nullopt for a budget row.
  std::optional<KvEvalTarget> target;
  double within_target = 0;  ///< an error-target row: the fraction of documents whose increase is <= max_rel_bpb
  int64_t documents = 0;
  double bpb = 0;       ///< bits per byte of the continuation with the policy: -sum log2 p / continuation
  double bpb_full = 0;  ///< the same with the full cache
  /// Fraction of the continuation's tokens that are the argmax of their logits, mean over documents (greedy
  /// decoding would emit them); `exact_match` is the fraction of documents whose every continuation token is.
  /// On a retrieval corpus whose continuation is the answer (a pass key), exact_match is retrieval accuracy.
  double token_accuracy = 0, token_accuracy_full = 0;
  double exact_match = 0, exact_match_full = 0;
  /// mean over documents of (bpb - bpb_full) / bpb_full; interval: bootstrap over source files (all documents of
  /// a file resampled together, kv_eval_bootstrap)
  KvEvalStat rel_bpb_increase;
  /// The worst decile: the 90th percentile of the documents' increases (the smallest increase of the worst 10%),
  /// with its distribution-free order-statistic interval (kv_quantile_with_ci)
  KvEvalStat worst_decile_rel_increase;
  double worst_decile_mean = 0;          ///< mean of the worst ceil(10%) of the documents' increases (>= 1 doc)
  KvEvalStat attn_rel_err;               ///< mean over layers, heads, queries and documents (kv_attention_rel_err)
  std::vector<double> attn_rel_err_per_layer;  ///< [layers]: the same mean per layer
  double kv_bytes = 0;       ///< KvCache::bytes() after the continuation with the policy, bytes
  double kv_bytes_full = 0;  ///< the same with the full cache, bytes
  /// The bytes each scored token's attention read (the cache before its decode() plus its own entries), averaged
  /// over the continuation's tokens, and their maximum; then means over documents. The equal-memory measure.
  double kv_bytes_mean = 0, kv_bytes_max = 0;
  double kv_bytes_full_mean = 0;  ///< kv_bytes_mean of the full cache
  std::vector<double> rel_per_document;  ///< the documents' increases, in document order
  double prefill_s = 0;      ///< wall seconds of the context's prefill (steady_clock)
  double decode_s = 0;       ///< wall seconds of the continuation's decode() calls, summed
  double abstained_heads = 0;  ///< KvPolicy::abstained_heads().size() at the end of the document
  /// [layers x heads], layer-major: the fraction of documents on which the policy abstained on that head
  /// (kept it exact; KvPolicy::abstained_heads() at the end of the document).
  std::vector<double> abstained_by_head;
};

/// Entries an ablated head keeps (KvEvalOptions::head_ablation): StreamingLLM's 4 sinks and a short recent
/// window, so that a head that reads only nearby tokens loses nothing it uses.
constexpr int64_t kKvAblationSinks = 4;
constexpr int64_t kKvAblationRecent = 16;

/// What cutting one head's cache did to the continuation, means over documents (causal ablation, as
/// DuoAttention finds its retrieval heads by what losing their context costs).
struct KvHeadAblation {
  int64_t layer = 0, head = 0;
  double token_accuracy = 0;    ///< as KvEvalRow::token_accuracy, with the head cut
  double exact_match = 0;       ///< as KvEvalRow::exact_match, with the head cut
  double rel_bpb_increase = 0;  ///< mean over documents of (bpb - bpb_full) / bpb_full
};

/// A paired comparison at one budget: per document d_i = increase(candidate) - increase(baseline), both runs on
/// the same document (negative: the candidate is better).
struct KvEvalPaired {
  double budget = 0;
  std::string candidate, baseline;
  int64_t documents = 0;
  KvEvalStat diff;      ///< mean of d_i with its bootstrap interval over source files
  double wins = 0;      ///< the fraction of documents with d_i < 0
  double bytes_ratio = 0;  ///< candidate's kv_bytes_mean over the baseline's
};

struct KvEvalResult {
  KvEvalOptions options;
  std::vector<KvEvalRow> rows;  ///< per policy in the given order, per budget in the given order; then targets
  std::vector<KvEvalPaired> paired;  ///< options.paired_against against every other non-full row, per budget
  std::vector<std::string> sources;  ///< the documents' sources, in document order
  int64_t source_files = 0;          ///< distinct files among them (the bootstrap's clusters)
  std::vector<std::string> files;    ///< those files (kv_source_file), sorted: kv_source_files(documents)
  double full_prefill_s = 0;    ///< the reference run (full cache, recording the continuation's queries)
  double full_decode_s = 0;
  /// With KvEvalOptions::head_ablation: one per (layer, head), layer-major (else empty).
  std::vector<KvHeadAblation> head_ablation;
};

/// Runs every (policy, budget) of `options` and the full-cache reference on every document (see the file
/// comment; at most documents x (1 + runs) sessions, one policy object per document and run). `model` must be a
/// softmax model in eval mode; documents need options.context + options.continuation + 1 tokens. Throws
/// std::invalid_argument for bad options (validate), a bad policy name or option (make_kv_policy's message), an
/// empty document list or a document that is too short, and for a model without softmax attention
/// (DecodeSession's message).
/// `on_document(done, total)`, when set, is called after each document (progress for long runs).
KvEvalResult run_kv_eval(Transformer& model, const std::vector<KvEvalDocument>& documents,
                         const KvEvalOptions& options,
                         const std::function<void(int64_t done, int64_t total)>& on_document = {});

/// Relative error of attention over a compressed cache against the full one, for one (layer, head):
/// o(q) = softmax(scale q.K^T + bias) V over the entries of each view (fp64 inside), and per query
/// ||o_c - o_f|| / ||o_f||. queries: [T, head_dim] floating (after rotary, unscaled). Returns [T] fp64 errors.
/// Throws std::invalid_argument for an empty view, head_dim or value_dim that differ, or scale <= 0.
torch::Tensor kv_attention_rel_err(const KvHeadView& full, const KvHeadView& compressed,
                                   const torch::Tensor& queries, double scale);

/// The mean of the worst (largest) ceil(fraction x n) values, at least one. Throws std::invalid_argument for
/// no values or fraction outside (0, 1].
double worst_fraction_mean(const std::vector<double>& values, double fraction = 0.1);

/// `statistic` of `values` and its 95% percentile bootstrap interval: `resamples` draws of values.size() values
/// with replacement, seeded by `seed` (the same seed draws the same document indices, so rows are resampled
/// together). Throws std::invalid_argument for no values or resamples < 1.
KvEvalStat bootstrap_stat(const std::vector<double>& values, double (*statistic)(const std::vector<double>&),
                          int64_t resamples, uint64_t seed);

/// The cluster (case-resampling) bootstrap of the mean (Davison & Hinkley 1997, 3.8): values come in clusters
/// (`cluster[i]` in [0, k), the documents cut from one source file), and each of `resamples` draws takes k
/// clusters with replacement and every value of each, so that correlated documents count as one unit; the
/// interval is the [2.5%, 97.5%] percentiles of the resampled means (value = the plain mean). Seeded by `seed`
/// (the same seed draws the same clusters for every row). Throws std::invalid_argument for no values, a cluster
/// list of another length, an id outside [0, k) or resamples < 1.
KvEvalStat kv_eval_bootstrap(const std::vector<double>& values, const std::vector<int64_t>& cluster,
                             int64_t resamples, uint64_t seed);

/// The q-quantile of `values` as an order statistic, x_(ceil(q n)) of the sorted values, with the
/// distribution-free interval [x_(l), x_(u)] whose coverage of the true quantile is >= `level` for independent
/// draws (the binomial order-statistic interval, David & Nagaraja 2003, 7.1: P(x_(l) <= xi_q < x_(u)) =
/// sum_{i=l}^{u-1} C(n, i) q^i (1-q)^(n-i), l and u the equal-tailed choice). An end that needs an order statistic
/// beyond the sample is -inf / +inf (too few documents to bound it). Throws std::invalid_argument for no values,
/// q or level outside (0, 1).
KvEvalStat kv_quantile_with_ci(const std::vector<double>& values, double q, double level = 0.95);

/// Which held-out documents calibrate and which evaluate: the held-out split's source files divided in two
/// halves by a hash of the file (the part of a sample's source before its last '#', so every chunk of a file
/// falls on the same side). Returns the ids of `ids` whose file falls on `side` ("calibration" or
/// "evaluation"). Throws std::invalid_argument for another side.
std::vector<int64_t> kv_eval_split(const Corpus& corpus, const std::vector<int64_t>& ids, const std::string& side);

/// The source file of a sample's source "path#chunk": what comes before the last '#' (the whole text without one),
/// its folder made canonical (std::filesystem::weakly_canonical: symlinks and ".." resolved, absolute), its file
/// name kept: the same file under another spelling of the corpus path is the same source file.
std::string kv_source_file(const std::string& source);

/// The distinct source files (kv_source_file) of `documents`, sorted.
std::vector<std::string> kv_source_files(const std::vector<KvEvalDocument>& documents);

/// The plain mean (a statistic for bootstrap_stat). Throws std::invalid_argument for no values.
double mean_of(const std::vector<double>& values);

}  // namespace dcp
