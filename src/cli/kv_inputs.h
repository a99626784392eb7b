// What `dcp kv-eval` and `dcp kv-calibrate` share: the checkpoint's model loaded for inference, the --out
// check, comma lists of fractions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dcp/config.h"
#include "dcp/model.h"

namespace dcp {

/// A softmax checkpoint loaded for inference.
struct KvModel {
  Config cfg;
  Transformer model{nullptr};
  int64_t threads = 0;     ///< intra-op threads set (torch::set_num_threads)
  int64_t parameters = 0;
  std::string description;  ///< e.g. "d_model 128, 4 layers, 4 heads (4 K/V heads), bf16"
};

/// Throws CLI::ValidationError (exit 2) naming `checkpoint` when its config `cfg` is not a softmax model (no KV cache
/// to compress); `command` names the subcommand.
void check_kv_checkpoint(const std::string& checkpoint, const Config& cfg, const std::string& command);

/// Loads `cfg` (load_checkpoint_config of `checkpoint`) and its weights in eval mode, with `threads` intra-op
/// threads (0 = the trainer's rule: train.threads, else every core). `command` names the subcommand in errors.
/// Throws CLI::ValidationError (exit 2) for a checkpoint whose attention is not softmax, and what load_checkpoint
/// throws (exit 1).
KvModel load_kv_model(const std::string& checkpoint, const Config& cfg, int64_t threads, const std::string& command);

/// `--out PREFIX` must be writable before a run that can take minutes: throws CLI::ValidationError naming it.
void check_kv_out_prefix(const std::string& prefix);

/// Whether a file can be created beside `path` (in its folder): a probe file of a new name (path + ".probe." + the
/// process id, created exclusively, so no existing file is touched) is created and removed. False when the folder
/// does not exist or cannot be written, or `path` is a folder.
bool can_create_beside(const std::string& path);

/// A comma list of items (no empty one). Throws CLI::ValidationError naming `option`.
std::vector<std::string> kv_split_list(const std::string& text, const std::string& option);
/// A comma list of numbers in (0, hi]. Throws CLI::ValidationError naming `option` and the item.
std::vector<double> kv_parse_numbers(const std::string& text, const std::string& option, double hi = 1.0);

}  // namespace dcp
