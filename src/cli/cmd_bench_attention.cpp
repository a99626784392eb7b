// `dcp bench-attention`: forward and backward time, useful FLOP rate against the measured matmul peak, and peak
// memory of one layer's attention operator, the tiled softmax against its reference and the Flexformer variants,
// over sequence lengths: its options, checked before anything is measured; the driver is tools/attention_bench_run.h.
#include <fmt/chrono.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <thread>

#include "cli/commands.h"
#include "tools/attention_bench_run.h"
#include "tools/bench_common.h"

namespace fs = std::filesystem;

namespace dcp {
namespace {

struct BenchAttentionOptions {
  std::string config_path;
  std::string lengths = "512,1024,2048,4096,8192,16384,32768,65536";
  std::string variants = "all";
  std::string dtype = "fp32";
  int64_t heads = 0, head_dim = 0, num_features = 0, chunk_size = 0;  // 0: from the config
  int64_t repetitions = 3;
  int64_t threads = 0;       // 0: every hardware thread
  int64_t matmul_size = 2048;  // n of the n^3 product whose rate is the peak
  double max_bytes = 0;      // 0: kDefaultMemoryShare of physical RAM
  double max_seconds = 60;
  std::string out;           // empty: bench/results/cpu<cores>_<yyyymm>_attention
  std::string note;
  bool plot = true;
};

// Softmax may use half of the RAM: the rest is for the process, the OS and whatever else shares the machine.
constexpr double kDefaultMemoryShare = 0.5;

std::vector<std::string> split(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(item);
  return out;
}

std::vector<int64_t> parse_lengths(const std::string& list) {
  std::vector<int64_t> out;
  for (const auto& item : split(list)) {
    size_t used = 0;
    int64_t len = 0;
    try {
      len = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || len < 1) {
      throw CLI::ValidationError(
          fmt::format("--lengths: bad length '{}' in '{}' (allowed: comma-separated integers >= 1)", item, list));
    }
    if (std::find(out.begin(), out.end(), len) != out.end()) {
      throw CLI::ValidationError(fmt::format("--lengths: length {} is listed twice in '{}'", len, list));
    }
    out.push_back(len);
  }
  if (out.empty()) throw CLI::ValidationError(fmt::format("--lengths: no length in '{}'", list));
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> parse_variants(const std::string& list) {
  const auto& known = attention_bench_variants();
  if (list == "all") return known;
  std::vector<std::string> out;
  for (const auto& name : split(list)) {
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      throw CLI::ValidationError(
          fmt::format("--variants: unknown variant '{}' (known: {}, or all)", name, fmt::join(known, ", ")));
    }
    if (std::find(out.begin(), out.end(), name) != out.end()) {
      throw CLI::ValidationError(fmt::format("--variants: variant '{}' is listed twice in '{}'", name, list));
    }
    out.push_back(name);
  }
  if (out.empty()) throw CLI::ValidationError(fmt::format("--variants: no variant in '{}'", list));
  return out;
}


// The config keys bench-attention reads: an override of any other key would be silently ignored (a user who
// writes --attention.feature_map=elu would time the map --variants names, not elu), so it is refused.
const std::vector<std::string>& bench_attention_keys() {
  static const std::vector<std::string> keys{"model.n_heads",         "model.d_model",        "attention.num_features",
                                             "attention.chunk_size",  "attention.input_norm", "attention.normalizer",
                                             "attention.tile_q",      "attention.tile_k",     "run.seed"};
  return keys;
}

void run_bench_attention(const BenchAttentionOptions& cli, const std::vector<std::string>& overrides) {
  for (const std::string& o : overrides) {
    const std::string key = o.substr(2, o.find('=') - 2);
    const auto& keys = bench_attention_keys();
    if (std::find(keys.begin(), keys.end(), key) == keys.end()) {
      throw CLI::ValidationError(fmt::format(
          "'{}': bench-attention does not use {} (it reads {}; the attention kinds and feature maps are chosen by "
          "--variants, the dtype by --dtype)",
          o, key, fmt::join(keys, ", ")));
    }
  }
  // A flag and the config key it replaces: the override would be silently ignored.
  const std::vector<std::pair<std::string, bool>> replaced{{"model.n_heads", cli.heads > 0},
                                                           {"model.d_model", cli.head_dim > 0},
                                                           {"attention.num_features", cli.num_features > 0},
                                                           {"attention.chunk_size", cli.chunk_size > 0}};
  for (const std::string& o : overrides) {
    for (const auto& [key, flag_given] : replaced) {
      if (flag_given && o.rfind("--" + key + "=", 0) == 0) {
        throw CLI::ValidationError(fmt::format("'{}' and the flag that replaces {} ({}) were both given: pass one",
                                               o, key,
                                               key == "model.n_heads"            ? "--heads"
                                               : key == "model.d_model"          ? "--head-dim"
                                               : key == "attention.num_features" ? "--num-features"
                                                                                 : "--chunk-size"));
      }
    }
  }
  const Config cfg = Config::load(cli.config_path, overrides);
  AttentionBenchOptions o;
  o.lengths = parse_lengths(cli.lengths);
  o.variants = parse_variants(cli.variants);
  o.dtype = cli.dtype;
  o.heads = cli.heads > 0 ? cli.heads : cfg.model.n_heads;
  o.head_dim = cli.head_dim > 0 ? cli.head_dim : cfg.model.d_model / cfg.model.n_heads;
  o.num_features = cli.num_features > 0 ? cli.num_features : cfg.attention.num_features;
  o.chunk_size = cli.chunk_size > 0 ? cli.chunk_size : cfg.attention.chunk_size;
  o.input_norm = cfg.attention.input_norm;
  o.normalizer = cfg.attention.normalizer;
  o.tile_q = cfg.attention.tile_q;
  o.tile_k = cfg.attention.tile_k;
  o.repetitions = cli.repetitions;
  o.max_bytes = cli.max_bytes > 0 ? cli.max_bytes : kDefaultMemoryShare * physical_memory_bytes();
  o.max_seconds = cli.max_seconds;
  o.seed = static_cast<uint64_t>(cfg.run.seed);
  if (cli.plot && !gnuplot_available()) {
    throw std::runtime_error("gnuplot not found in PATH; install it (scripts/install-deps.sh installs gnuplot-nox) "
                             "or pass --no-plot");
  }
  const fs::path prefix = cli.out.empty() ? fs::path(fmt::format("bench/results/cpu{}_{}_attention",
                                                                 std::thread::hardware_concurrency(), utc_now("%Y%m")))
                                          : fs::path(cli.out);
  if (prefix.has_parent_path()) {
    std::error_code ec;
    fs::create_directories(prefix.parent_path(), ec);
    if (ec) {
      throw CLI::ValidationError(fmt::format("--out '{}': cannot create the folder '{}': {}", cli.out,
                                             prefix.parent_path().string(), ec.message()));
    }
  }
  const fs::path md = prefix.string() + ".md", csv = prefix.string() + ".csv", png = prefix.string() + ".png";
  {  // an unwritable --out fails now, not after the measurements (and leaves no empty file behind)
    const bool existed = fs::exists(csv);
    const bool writable = std::ofstream(csv, std::ios::app).good();
    if (!existed && writable) fs::remove(csv);
    if (!writable) throw CLI::ValidationError(fmt::format("--out '{}': cannot write '{}'", cli.out, csv.string()));
  }
  AttentionBenchRun run;
  run.options = o;
  run.threads = cli.threads;
  run.matmul_size = cli.matmul_size;
  run.prefix = prefix.string();
  run.note = cli.note;
  run.plot = cli.plot;
  run_attention_bench(run);
}

}  // namespace

void add_bench_attention_command(CLI::App& app) {
  auto* sub = app.add_subcommand("bench-attention", "Time and measure one attention layer's forward and backward "
                                                    "against sequence length: the tiled softmax vs its reference and "
                                                    "the flexformer variants, with GFLOP/s against the matmul peak");
  auto opt = std::make_shared<BenchAttentionOptions>();
  sub->add_option("--config", opt->config_path, "YAML config whose model.n_heads, d_model / n_heads, attention.* "
                                                "(num_features, chunk_size, input_norm, normalizer, tile_q, tile_k) "
                                                "and run.seed are used; other keys of the file are not read, and "
                                                "--section.key=value overrides of them are refused")
      ->check(CLI::ExistingFile);
  sub->add_option("--lengths", opt->lengths, "comma-separated sequence lengths, tokens")->capture_default_str();
  sub->add_option("--variants", opt->variants,
                  fmt::format("comma-separated variants; all = {}", fmt::join(attention_bench_variants(), ",")))
      ->capture_default_str();
  sub->add_option("--dtype", opt->dtype, "dtype of q, k, v and the output gradient: fp32 or bf16")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& dtype) -> std::string {
            const auto& known = attention_bench_dtypes();
            if (std::find(known.begin(), known.end(), dtype) != known.end()) return "";
            return fmt::format("unknown dtype '{}' (allowed: {})", dtype, fmt::join(known, ", "));
          },
          "fp32|bf16"));
  sub->add_option("--heads", opt->heads, "attention heads (default: model.n_heads, 4)")->check(CLI::Range(1, 4096));
  sub->add_option("--head-dim", opt->head_dim, "dimension per head (default: model.d_model / model.n_heads, 32)")
      ->check(CLI::Range(1, 65536));
  sub->add_option("--num-features", opt->num_features, "flexformer frequencies per head (default: "
                                                        "attention.num_features, 64; at most 65536, as the config)")
      ->check(CLI::Range(1, 1 << 16));
  sub->add_option("--chunk-size", opt->chunk_size,
                  "flexformer chunk size, tokens (default: attention.chunk_size, 64; at most 2^20, as the config)")
      ->check(CLI::Range(1, 1 << 20));
  sub->add_option("--repetitions", opt->repetitions, "timed runs per point after one warm-up (median)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  sub->add_option("--threads", opt->threads, "intra-op threads (default: every hardware thread)")
      ->check(CLI::Range(1, 4096));
  sub->add_option("--matmul-size", opt->matmul_size, "n of the n x n x n fp32 and bf16 matmuls whose median rate "
                                                     "is the peak of the % of peak columns (at most 8192: three "
                                                     "fp32 n x n matrices, 805 MB)")
      ->capture_default_str()
      ->check(CLI::Range(1, 8192));
  sub->add_option("--max-bytes", opt->max_bytes, "skip lengths whose predicted peak exceeds this many bytes, >= 1 "
                                                 "(default: half of the physical RAM)")
      ->check(finite_number_validator("bytes", 1));
  sub->add_option("--max-seconds", opt->max_seconds, "once a run of a variant takes longer, skip its longer lengths")
      ->capture_default_str()
      ->check(finite_number_validator("seconds"));
  sub->add_option("--out", opt->out, "path prefix of the .md, .csv and .png results, ending in a file name stem "
                                     "(default: bench/results/cpu<hardware threads>_<yyyymm>_attention)")
      ->check(CLI::Validator(
          [](std::string& out) -> std::string {
            if (out.empty() || fs::path(out).filename().empty()) {
              return fmt::format("must be a path prefix ending in a file name stem, e.g. bench/results/mine, got "
                                 "'{}'",
                                 out);
            }
            return "";
          },
          "PREFIX"));
  sub->add_option("--note", opt->note, "a sentence added to the report's machine line (e.g. what else ran)");
  sub->add_flag("!--no-plot", opt->plot, "skip the gnuplot PNG");
  sub->allow_extras();
  sub->footer("Config keys can be overridden as --section.key=value (e.g. --attention.normalizer=clamp).");
  sub->callback([sub, opt] { run_bench_attention(*opt, config_overrides(*sub)); });
}

}  // namespace dcp
