// Shared inputs of `dcp kv-eval` and `dcp kv-calibrate` (src/cli/kv_inputs.h).
#include "cli/kv_inputs.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cli/commands.h"
#include "dcp/checkpoint.h"
#include "dcp/precision.h"
#include "runtime/optimizer.h"
#include "util/number_text.h"

namespace dcp {
namespace fs = std::filesystem;

void check_kv_checkpoint(const std::string& checkpoint, const Config& cfg, const std::string& command) {
  if (cfg.attention.backend != "softmax") {
    throw CLI::ValidationError(fmt::format("--checkpoint '{}': attention.backend is '{}'; {} needs a softmax model "
                                           "(flexformer models decode from recurrent states, with no KV cache to "
                                           "compress)",
                                           checkpoint, cfg.attention.backend, command));
  }
}

KvModel load_kv_model(const std::string& checkpoint, const Config& cfg, int64_t threads, const std::string& command) {
  check_kv_checkpoint(checkpoint, cfg, command);
  KvModel m;
  m.cfg = cfg;
  // --threads, else the trainer's rule (train.threads, else every core of this one process).
  m.threads = threads > 0 ? threads : threads_per_rank(cfg.train, DistEnv{});
  torch::set_num_threads(static_cast<int>(m.threads));
  const Precision precision = resolve_precision(cfg.train.precision).precision;
  m.model = Transformer(cfg.model, cfg.attention, precision);
  load_checkpoint(checkpoint, m.model, nullptr);
  m.model->eval();
  for (const auto& p : m.model->parameters()) m.parameters += p.numel();
  m.description = fmt::format("d_model {}, {} layers, {} heads ({} K/V heads), {}", cfg.model.d_model,
                              cfg.model.n_layers, cfg.model.n_heads, cfg.model.kv_heads(),
                              precision == Precision::kBf16 ? "bf16" : "fp32");
  return m;
}

bool can_create_beside(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) return false;
  const std::string probe = fmt::format("{}.probe.{}", path, ::getpid());
  std::FILE* f = std::fopen(probe.c_str(), "wx");  // exclusive: never an existing file
  if (f == nullptr) return false;
  std::fclose(f);
  fs::remove(probe, ec);
  return true;
}

void check_kv_out_prefix(const std::string& prefix) {
  const fs::path md = prefix + ".md";
  std::error_code ec;
  if (!md.parent_path().empty()) fs::create_directories(md.parent_path(), ec);
  // A probe file beside the report, removed again: a failed run leaves no empty report behind.
  const bool ok = !ec && can_create_beside(md.string());
  if (!ok) {
    throw CLI::ValidationError(fmt::format("--out '{}': cannot write a file in '{}'", prefix,
                                           md.parent_path().empty() ? "." : md.parent_path().string()));
  }
}

std::vector<std::string> kv_split_list(const std::string& text, const std::string& option) {
  std::vector<std::string> items;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) items.push_back(item);
  if (!text.empty() && text.back() == ',') items.emplace_back();
  for (const auto& i : items) {
    if (i.empty()) throw CLI::ValidationError(fmt::format("{} '{}': empty entry in the comma list", option, text));
  }
  if (items.empty()) throw CLI::ValidationError(fmt::format("{}: empty list", option));
  return items;
}

std::vector<double> kv_parse_numbers(const std::string& text, const std::string& option, double hi) {
  std::vector<double> out;
  for (const auto& item : kv_split_list(text, option)) {
    const std::optional<double> v = parse_decimal(item);  // no nan or inf
    if (!v || !(*v > 0 && *v <= hi)) {
      throw CLI::ValidationError(fmt::format("{}: '{}' is not a number in (0, {:g}]", option, item, hi));
    }
    out.push_back(*v);
  }
  return out;
}

}  // namespace dcp
