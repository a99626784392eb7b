#include "dcp/config.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>

#include "dcp/sp_layout.h"
#include "util/number_text.h"

namespace dcp {
namespace {

struct IntRule {
  int64_t min = std::numeric_limits<int64_t>::min();
  int64_t max = std::numeric_limits<int64_t>::max();
};
struct RealRule {
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
};
using Choices = std::vector<std::string>;
struct EmptyOrText {};  // a string whose empty value means "the default" (e.g. a folder resolved at run time)

// The largest value of a key that torch converts to a float32 scalar (train.grad_clip, in clip_grad_norm_): above
// FLT_MAX (3.4e38) it fails deep inside the run without naming the key. (model.rope_theta needs no bound: a
// theta of 1e39 trains, its powers are taken in double.)
constexpr double kFloatKeyMax = 1e30;

// The one list of configuration keys. Each entry binds a key to its member and its rule; loading,
// overrides, printing and validation all walk this list, so a key is declared exactly once.
template <class C, class F>
void visit(C& c, F&& f) {
  f("run.dir", c.run.dir, Choices{});
  f("run.seed", c.run.seed, IntRule{0});
  f("run.log_level", c.run.log_level, Choices{"trace", "debug", "info", "warn", "error"});
  f("data.path", c.data.path, Choices{});
  f("data.format", c.data.format, Choices{"auto", "text_dir", "jsonl"});
  f("data.glob", c.data.glob, Choices{});
  f("data.max_seq_len", c.data.max_seq_len, IntRule{2, 1 << 24});
  f("data.heldout_fraction", c.data.heldout_fraction, RealRule{0.0, 0.9});
  f("model.d_model", c.model.d_model, IntRule{2, 1 << 16});
  f("model.n_layers", c.model.n_layers, IntRule{1, 1024});
  f("model.n_heads", c.model.n_heads, IntRule{1, 1024});
  f("model.n_kv_heads", c.model.n_kv_heads, IntRule{0, 1024});
  f("model.d_ff", c.model.d_ff, IntRule{1, 1 << 20});
  f("model.rope_theta", c.model.rope_theta, RealRule{1.0});
  f("model.recompute_layers", c.model.recompute_layers, IntRule{0, 1024});
  f("attention.backend", c.attention.backend, Choices{"softmax", "flexformer"});
  f("attention.impl", c.attention.impl, Choices{"tiled", "reference"});
  f("attention.linear_impl", c.attention.linear_impl, Choices{"fused", "reference"});
  f("attention.tile_q", c.attention.tile_q, IntRule{1, 4096});
  f("attention.tile_k", c.attention.tile_k, IntRule{1, 4096});
  f("attention.feature_map", c.attention.feature_map, Choices{"stationary", "nonstationary", "fixed", "elu"});
  f("attention.num_features", c.attention.num_features, IntRule{1, 1 << 16});
  f("attention.input_norm", c.attention.input_norm, Choices{"l2", "rms", "scale"});
  f("attention.normalizer", c.attention.normalizer, Choices{"shift", "clamp", "none"});
  f("attention.mode", c.attention.mode, Choices{"chunk", "quadratic", "recurrent"});
  f("attention.chunk_size", c.attention.chunk_size, IntRule{1, 1 << 20});
  f("memory.budget_bytes", c.memory.budget_bytes, RealRule{0.0});
  f("memory.fraction", c.memory.fraction, RealRule{0.01, 1.0});
  f("memory.margin", c.memory.margin, RealRule{0.0, 0.5});
  f("train.global_batch_tokens", c.train.global_batch_tokens, IntRule{1});
  f("train.micro_batch_tokens", c.train.micro_batch_tokens, IntRule{1});
  f("train.max_steps", c.train.max_steps, IntRule{0});
  f("train.lr", c.train.lr, RealRule{0.0, 10.0});
  f("train.min_lr_ratio", c.train.min_lr_ratio, RealRule{0.0, 1.0});
  f("train.warmup_steps", c.train.warmup_steps, IntRule{0});
  f("train.weight_decay", c.train.weight_decay, RealRule{0.0, 10.0});
  f("train.beta1", c.train.beta1, RealRule{0.0, 0.999999});
  f("train.beta2", c.train.beta2, RealRule{0.0, 0.999999});
  f("train.grad_clip", c.train.grad_clip, RealRule{0.0, kFloatKeyMax});
  f("train.checkpoint_every", c.train.checkpoint_every, IntRule{0});
  f("train.stop_after_steps", c.train.stop_after_steps, IntRule{0});
  f("train.threads", c.train.threads, IntRule{0, 1024});
  f("train.nonfinite", c.train.nonfinite, Choices{"stop", "skip"});
  f("train.nonfinite_max_skips", c.train.nonfinite_max_skips, IntRule{0, 1000000});
  f("train.precision", c.train.precision, Choices{"auto", "bf16", "fp32"});
  f("train.planner", c.train.planner, Choices{"static", "bucket", "packed", "dcp-intra", "dcp-inter", "dcp-inter-pac", "dcp-opt"});
  f("train.max_rounds", c.train.max_rounds, IntRule{0, 1 << 20});
  f("train.cost_model", c.train.cost_model, Choices{});
  f("train.profile_dir", c.train.profile_dir, EmptyOrText{});
  f("train.profile_max_length", c.train.profile_max_length, IntRule{0, 1 << 24});
  f("parallel.sp_size", c.parallel.sp_size, IntRule{0, 1 << 20});
  f("parallel.sp_sizes", c.parallel.sp_sizes, Choices{});
  f("parallel.sp_mode", c.parallel.sp_mode, Choices{"ulysses", "ring", "ulysses-ring"});
  f("parallel.ulysses_size", c.parallel.ulysses_size, IntRule{0, 1 << 20});
  f("eval.max_tokens", c.eval.max_tokens, IntRule{0});
  f("dist.timeout_s", c.dist.timeout_s, RealRule{0.1, 86400.0});
  f("kv.chunk_tokens", c.kv.chunk_tokens, IntRule{1, 1 << 24});
  f("kv.chunk_pairs", c.kv.chunk_pairs, IntRule{0, int64_t{1} << 48});
  f("kv.policy", c.kv.policy, Choices{});  // checked by make_kv_policy where a cache is built (dcp generate)
  f("kv.budget", c.kv.budget, RealRule{0.0, 1e15});
  f("kv.max_rel_bpb", c.kv.max_rel_bpb, RealRule{0.0, 1.0});
  f("serve.host", c.serve.host, Choices{});
  f("serve.port", c.serve.port, IntRule{0, 65535});
  f("serve.threads", c.serve.threads, IntRule{0, 1024});
  f("serve.http_threads", c.serve.http_threads, IntRule{1, 4096});
  f("serve.kv_policy", c.serve.kv_policy, EmptyOrText{});  // checked by make_kv_policy when the server starts
  f("serve.kv_budget", c.serve.kv_budget, RealRule{0.0, 1e15});
  f("serve.kv_memory_bytes", c.serve.kv_memory_bytes, RealRule{1.0});
  f("serve.max_sessions", c.serve.max_sessions, IntRule{1, 1 << 16});
  f("serve.max_queue", c.serve.max_queue, IntRule{0, 1 << 20});
  f("serve.max_tokens", c.serve.max_tokens, IntRule{1, 1 << 24});
  f("serve.default_max_tokens", c.serve.default_max_tokens, IntRule{1, 1 << 24});
  f("serve.max_prompt_bytes", c.serve.max_prompt_bytes, IntRule{1, 1 << 30});
  f("serve.max_body_bytes", c.serve.max_body_bytes, IntRule{64, 1 << 30});
  f("serve.max_context", c.serve.max_context, IntRule{0, 1 << 30});
  f("serve.chunk_tokens", c.serve.chunk_tokens, IntRule{0, 1 << 24});
  f("serve.prefill_chunks", c.serve.prefill_chunks, IntRule{1, 1 << 16});
  f("serve.scheduler", c.serve.scheduler, Choices{"batched", "sequential"});
  f("serve.http_priority", c.serve.http_priority, Choices{"low", "idle", "normal"});
  f("serve.prefill_step_ratio", c.serve.prefill_step_ratio, RealRule{0.0, 1000.0});
  f("serve.prefill_step_ms", c.serve.prefill_step_ms, RealRule{0.0, 60000.0});
  f("serve.shutdown_grace_s", c.serve.shutdown_grace_s, RealRule{0.0, 86400.0});
  f("serve.retry_after_s", c.serve.retry_after_s, IntRule{0, 86400});
}

std::string join(const Choices& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

std::string describe(const IntRule& r) {
  if (r.max == std::numeric_limits<int64_t>::max()) return fmt::format("an integer >= {}", r.min);
  return fmt::format("an integer in [{}, {}]", r.min, r.max);
}
// "decimal": hex, inf and nan are refused (parse_decimal), as the message says.
std::string describe(const RealRule& r) {
  if (std::isinf(r.max)) return fmt::format("a finite decimal number >= {}", r.min);
  return fmt::format("a decimal number in [{}, {}]", r.min, r.max);
}

[[noreturn]] void fail(const std::string& key, const std::string& value, const std::string& allowed) {
  throw ConfigError(fmt::format("config key '{}': bad value '{}' (allowed: {})", key, value, allowed));
}

void parse_into(const std::string& key, const std::string& text, int64_t& out, const IntRule& r) {
  std::size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    fail(key, text, describe(r));
  }
  if (used != text.size() || v < r.min || v > r.max) fail(key, text, describe(r));
  out = v;
}

void parse_into(const std::string& key, const std::string& text, double& out, const RealRule& r) {
  const std::optional<double> v = parse_decimal(text);
  if (!v || !std::isfinite(*v) || *v < r.min || *v > r.max) fail(key, text, describe(r));
  out = *v;
}

void parse_into(const std::string& key, const std::string& text, std::string& out, const Choices& c) {
  if (!c.empty() && std::find(c.begin(), c.end(), text) == c.end()) fail(key, text, "one of " + join(c));
  if (c.empty() && text.empty()) fail(key, text, "a non-empty string");
  out = text;
}

void parse_into(const std::string&, const std::string& text, std::string& out, const EmptyOrText&) { out = text; }

std::string to_text(int64_t v) { return std::to_string(v); }
std::string to_text(const std::string& v) { return v; }
// Shortest text that reads back as the same double, so config.yaml shows 0.1 rather than 0.10000000000000001.
std::string to_text(double v) {
  for (int precision = 6; precision < 17; ++precision) {
    std::string s = fmt::format("{:.{}g}", v, precision);
    if (parse_decimal(s) == v) return s;  // not std::stod, which throws out_of_range for a denormal (1e-320)
  }
  return fmt::format("{:.17g}", v);
}

std::vector<std::string> known_keys() {
  std::vector<std::string> keys;
  Config c;
  visit(c, [&](const char* k, auto&, auto&&) { keys.emplace_back(k); });
  return keys;
}

// Flattens a YAML mapping of sections into "section.key" -> scalar text. A key given twice in one mapping is
// refused with both lines (yaml-cpp keeps both pairs, and the last would win silently).
void flatten(const YAML::Node& node, const std::string& prefix, std::map<std::string, std::string>& out,
             const std::string& path) {
  if (!node.IsMap()) throw ConfigError(fmt::format("config file '{}': expected a mapping at '{}'", path, prefix));
  std::map<std::string, int> line_of;  // key -> its 1-based line
  for (const auto& kv : node) {
    std::string key = kv.first.as<std::string>();
    std::string full = prefix.empty() ? key : prefix + "." + key;
    const int line = kv.first.Mark().line + 1;
    if (const auto [it, first] = line_of.emplace(key, line); !first) {
      throw ConfigError(fmt::format("config file '{}': key '{}' is given twice (lines {} and {})", path, full,
                                    it->second, line));
    }
    if (kv.second.IsMap()) {
      flatten(kv.second, full, out, path);
    } else if (kv.second.IsScalar()) {
      out[full] = kv.second.as<std::string>();
    } else {
      throw ConfigError(fmt::format("config file '{}': key '{}' must be a scalar value", path, full));
    }
  }
}

// The text of config file `path`: a regular file, or a pipe (`--config <(cat x.yaml)`) that has something to
// read (data or its end) within kPipeWaitMs. A FIFO no process writes to, a device or a folder is refused,
// never waited on (ConfigError: the --config is a usage error), and so is a pipe that gives no data (another
// process, e.g. a second rank, read it first).
std::string read_config_file(const std::string& path) {
  constexpr int kPipeWaitMs = 2000;
  auto refuse = [&](const std::string& why) { return ConfigError(fmt::format("config file '{}' {}", path, why)); };
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw refuse(fmt::format("cannot be opened: {}", std::strerror(errno)));
  if (S_ISDIR(st.st_mode)) throw refuse("is a folder, not a YAML file");
  if (!S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode)) {
    throw refuse("is not a regular file (a device or a socket): give a YAML file");
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);  // a FIFO's open would wait for a writer
  if (fd < 0) throw refuse(fmt::format("cannot be opened: {}", std::strerror(errno)));
  std::string text;
  try {
    if (S_ISFIFO(st.st_mode)) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, kPipeWaitMs) <= 0) {
        throw refuse(fmt::format("is a pipe with nothing to read after {} s (a FIFO that no process writes to?): "
                                 "give a regular file",
                                 kPipeWaitMs / 1000));
      }
    }
    ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    char buf[65536];
    for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) != 0;) {
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw refuse(fmt::format("cannot be read: {}", std::strerror(errno)));
      text.append(buf, static_cast<size_t>(n));
    }
    if (S_ISFIFO(st.st_mode) && text.empty()) throw refuse("is a pipe that gave no data");
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return text;
}

}  // namespace

void Config::set(const std::string& key, const std::string& value) {
  bool found = false;
  visit(*this, [&](const char* k, auto& member, const auto& rule) {
    if (key != k) return;
    found = true;
    parse_into(key, value, member, rule);
  });
  if (!found) {
    throw ConfigError(fmt::format("unknown config key '{}' (value '{}'); known keys: {}", key, value,
                                  join(known_keys())));
  }
}

void Config::validate() const {
  if (model.d_model % model.n_heads != 0) {
    throw ConfigError(fmt::format("config key 'model.n_heads': bad value '{}' (allowed: a divisor of model.d_model={})",
                                  model.n_heads, model.d_model));
  }
  if ((model.d_model / model.n_heads) % 2 != 0) {
    throw ConfigError(fmt::format(
        "config key 'model.n_heads': bad value '{}' (allowed: head_dim = d_model/n_heads must be even for rotary "
        "embeddings; d_model={})",
        model.n_heads, model.d_model));
  }
  if (model.n_heads % model.kv_heads() != 0) {
    throw ConfigError(fmt::format("config key 'model.n_kv_heads': bad value '{}' (allowed: 0 = n_heads, or a divisor "
                                  "of model.n_heads={})",
                                  model.n_kv_heads, model.n_heads));
  }
  if (model.kv_heads() != model.n_heads && attention.backend != "softmax") {
    throw ConfigError(fmt::format("config key 'model.n_kv_heads': bad value '{}' with attention.backend {} (allowed: "
                                  "grouped-query attention with the softmax backend only; 0 = n_heads)",
                                  model.n_kv_heads, attention.backend));
  }
  if (parallel.sp_mode == "ulysses" && parallel.sp_size > 0 && model.kv_heads() % parallel.sp_size != 0) {
    throw ConfigError(fmt::format(
        "config key 'parallel.sp_size': bad value '{}' (allowed: a divisor of the K/V heads, {}; Ulysses shards "
        "heads; parallel.sp_mode ring has no such bound)",
        parallel.sp_size, model.kv_heads()));
  }
  if (parallel.sp_mode != "ulysses" && attention.backend != "softmax") {
    throw ConfigError(fmt::format(
        "config key 'parallel.sp_mode': bad value '{}' with attention.backend {} (allowed: ulysses; ring modes merge "
        "partial softmax results by their logsumexps, so they need attention.backend softmax)",
        parallel.sp_mode, attention.backend));
  }
  if (parallel.sp_mode != "ulysses-ring" && parallel.ulysses_size != 0) {
    throw ConfigError(fmt::format("config key 'parallel.ulysses_size': bad value '{}' (allowed: 0 unless "
                                  "parallel.sp_mode is ulysses-ring; it is {})",
                                  parallel.ulysses_size, parallel.sp_mode));
  }
  if (parallel.sp_mode == "ulysses-ring") {
    if (parallel.sp_size < 4) {
      throw ConfigError(fmt::format(
          "config key 'parallel.sp_size': bad value '{}' (allowed: >= 4 with parallel.sp_mode ulysses-ring, which "
          "splits a fixed size into subgroups of 1 < ulysses_size < sp_size; use ulysses or ring below 4)",
          parallel.sp_size));
    }
    const int64_t u = ulysses_ring_size(parallel.sp_size, parallel.ulysses_size, model.kv_heads());
    if (u == 0) {
      throw ConfigError(fmt::format(
          "config key 'parallel.ulysses_size': bad value '{}' with parallel.sp_size {} and {} K/V heads "
          "(allowed: a divisor of both, strictly between 1 and sp_size; 0 picks the largest)",
          parallel.ulysses_size, parallel.sp_size, model.kv_heads()));
    }
  }
  if (model.recompute_layers > model.n_layers) {
    throw ConfigError(fmt::format("config key 'model.recompute_layers': bad value '{}' (allowed: 0..model.n_layers={})",
                                  model.recompute_layers, model.n_layers));
  }
  if (train.micro_batch_tokens < data.max_seq_len) {
    throw ConfigError(fmt::format(
        "config key 'train.micro_batch_tokens': bad value '{}' (allowed: >= data.max_seq_len={}, so that every "
        "sample fits in one micro-batch)",
        train.micro_batch_tokens, data.max_seq_len));
  }
}

Config Config::load(const std::string& path, const std::vector<std::string>& overrides) {
  Config c;
  if (!path.empty()) {
    const std::string text = read_config_file(path);
    YAML::Node root;
    try {
      root = YAML::Load(text);
    } catch (const YAML::Exception& e) {
      throw ConfigError(fmt::format("config file '{}' is not valid YAML: {}", path, e.what()));
    }
    std::map<std::string, std::string> flat;
    if (root && !root.IsNull()) flatten(root, "", flat, path);
    for (const auto& [k, v] : flat) c.set(k, v);
  }
  for (const auto& o : overrides) {
    std::string s = o.rfind("--", 0) == 0 ? o.substr(2) : o;
    auto eq = s.find('=');
    if (eq == std::string::npos) {
      throw ConfigError(fmt::format("override '{}' must have the form --section.key=value", o));
    }
    c.set(s.substr(0, eq), s.substr(eq + 1));
  }
  c.validate();
  return c;
}

std::vector<std::pair<std::string, std::string>> Config::items() const {
  std::vector<std::pair<std::string, std::string>> out;
  visit(*this, [&](const char* k, const auto& member, auto&&) { out.emplace_back(k, to_text(member)); });
  return out;
}

std::string Config::to_yaml() const {
  YAML::Emitter e;
  e << YAML::BeginMap;
  std::string section;
  for (const auto& [key, value] : items()) {
    auto dot = key.find('.');
    std::string sec = key.substr(0, dot);
    if (sec != section) {
      if (!section.empty()) e << YAML::EndMap;
      e << YAML::Key << sec << YAML::Value << YAML::BeginMap;
      section = sec;
    }
    e << YAML::Key << key.substr(dot + 1) << YAML::Value << value;
  }
  if (!section.empty()) e << YAML::EndMap;
  e << YAML::EndMap;
  return std::string(e.c_str()) + "\n";
}

}  // namespace dcp
