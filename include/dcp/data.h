// Corpus readers, byte-level tokens and the Sample list the planner sees (no tensors here).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "dcp/config.h"

namespace dcp {

/// Byte-level vocabulary: token t < 256 is the byte t; kBosToken starts every sample.
constexpr int64_t kBosToken = 256;
constexpr int64_t kVocabSize = 257;

/// One training or held-out sequence. `length` counts model positions in tokens, which equals the number of
/// target tokens and the number of bytes of the chunk: the model reads [BOS, b0, ..., b(n-2)] and predicts
/// [b0, ..., b(n-1)].
struct Sample {
  int64_t id = 0;        ///< dense index into Corpus::samples(), stable for a given corpus and config
  int64_t length = 0;    ///< tokens
  std::string source;    ///< "path#chunk" (text folder) or "path:line#chunk" (JSONL)
};

/// Documents that were not turned into samples, counted by reason ("empty", "binary", "unreadable",
/// "jsonl_bad_line", "jsonl_no_text"), with a few example sources per reason for the error report.
struct SkipReport {
  std::map<std::string, int64_t> by_reason;
  std::map<std::string, std::vector<std::string>> examples;  ///< at most 3 per reason
  int64_t total() const;
  void add(const std::string& reason, const std::string& source);
};

/// All samples of a corpus in memory, split by document into train and held-out sets.
///
/// Reads either a folder of text files (recursive; files whose base name matches `data.glob`, visited in
/// sorted path order) or a JSONL file whose lines are objects with a string field `text`. Documents longer
/// than `data.max_seq_len` bytes are split into chunks of at most that many bytes. Empty documents, binary
/// ones (a NUL byte or invalid UTF-8) and unreadable files are skipped and counted in skipped().
/// Files or folders that cannot be read count as "unreadable". The split puts a document in the held-out set
/// when FNV-1a-64 of its path relative to `data.path` (its line number for JSONL, its name for
/// from_documents) falls in the lowest `data.heldout_fraction` of the hash range, so the split depends neither
/// on file order nor on where the corpus is installed.
class Corpus {
 public:
  /// Throws std::runtime_error naming the path when it does not exist (for the default corpus the message
  /// names the Debian package `python3.11-doc`), when `data.format` does not fit the path, or when no training
  /// sample remains after skipping.
  static Corpus load(const DataConfig& cfg);

  /// Builds a corpus from in-memory documents (name, text); the same skipping, chunking and split apply.
  static Corpus from_documents(const std::vector<std::pair<std::string, std::string>>& docs, const DataConfig& cfg);

  const std::vector<Sample>& samples() const { return samples_; }
  const std::vector<int64_t>& train_ids() const { return train_ids_; }
  const std::vector<int64_t>& heldout_ids() const { return heldout_ids_; }
  const SkipReport& skipped() const { return skipped_; }
  int64_t num_documents() const { return num_documents_; }

  /// The bytes of sample `id` (length() bytes). Throws std::out_of_range for an unknown id.
  std::string_view bytes(int64_t id) const;

  /// Writes the model inputs (BOS then the first length-1 bytes) and targets (the length bytes) of sample `id`.
  void tokens(int64_t id, int64_t* inputs, int64_t* targets) const;

 private:
  void add_document(const std::string& source, std::string_view split_key, std::string_view text, int64_t max_seq_len,
                    double heldout_fraction);

  std::string text_;                 // all kept document bytes, concatenated
  std::vector<int64_t> offsets_;     // offsets_[id] = start of sample id in text_
  std::vector<Sample> samples_;
  std::vector<int64_t> train_ids_;
  std::vector<int64_t> heldout_ids_;
  SkipReport skipped_;
  int64_t num_documents_ = 0;        // documents kept (not skipped)
};

/// Why a document is not usable as text, or "" when it is: "empty", or "binary" (NUL byte or invalid UTF-8).
std::string classify_document(std::string_view text);

/// The length distribution of a set of samples (tokens), as the trainer prints it: what decides whether a job
/// needs sequence parallelism and recompute. Percentiles are nearest-rank (the smallest length with at least
/// p% of the samples at or below it).
struct LengthHistogram {
  int64_t count = 0;   ///< samples
  int64_t tokens = 0;  ///< sum of the lengths
  int64_t min = 0, p50 = 0, p90 = 0, max = 0;
  /// (2^k, share of all tokens that are in samples longer than 2^k), for k = 0, 1, ... while 2^k < max;
  /// shares in [0, 1]. Empty when there are no samples or max is 1.
  std::vector<std::pair<int64_t, double>> token_share_above;

  /// One line: "N samples, T tokens; min a, p50 b, p90 c, max d; tokens in samples > 512: 61.2%, > 1024: ...",
  /// listing the powers of two from the last whose share prints as 100.0%.
  std::string describe() const;
};

/// The LengthHistogram of `lengths` (tokens, each >= 1; an empty list gives count 0). Throws
/// std::invalid_argument naming the index and value of a length below 1.
LengthHistogram length_histogram(const std::vector<int64_t>& lengths);

/// FNV-1a 64-bit hash; stable across platforms and runs.
uint64_t fnv1a64(std::string_view s);

/// Seed of the random stream that touches one sample in one epoch, independent of the rank layout:
/// a SplitMix64 mix of (seed, epoch, sample_id).
uint64_t sample_seed(uint64_t seed, uint64_t epoch, uint64_t sample_id);

}  // namespace dcp
