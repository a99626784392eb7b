#include "profile/cache.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "dcp/planning.h"
#include "dcp/precision.h"
#include "util/file_lock.h"
#include "util/file_write.h"
#include "util/hash.h"
#include "util/logging.h"

namespace dcp {
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The fields in which two cache keys differ, each "name A there, B now" ("none" for a missing field).
std::vector<std::string> key_differences(const json& there, const json& now) {
  json fields = there.is_object() ? there : json::object();
  if (now.is_object()) fields.update(now);
  auto value = [](const json& key, const std::string& field) {
    return key.is_object() && key.contains(field) ? key[field].dump() : std::string("none");
  };
  std::vector<std::string> out;
  for (const auto& [field, unused] : fields.items()) {
    const std::string a = value(there, field), b = value(now, field);
    if (a != b) out.push_back(fmt::format("{} {} there, {} now", field, a, b));
  }
  return out;
}

// The cache file in `dir` whose key differs from `key` in the fewest fields, as "'<file>': <differences>", or ""
// when the folder holds no readable cache file.
std::string closest_cached_key(const fs::path& dir, const json& key) {
  std::string best;
  size_t best_count = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("profile-", 0) != 0 || entry.path().extension() != ".json") continue;
    const json doc = json::parse(read_text(entry.path()), nullptr, /*allow_exceptions=*/false);
    if (!doc.is_object() || !doc.contains("cache_key")) continue;
    const std::vector<std::string> differences = key_differences(doc["cache_key"], key);
    if (best.empty() || differences.size() < best_count) {
      best = fmt::format("'{}': {}", entry.path().string(), fmt::join(differences, "; "));
      best_count = differences.size();
    }
  }
  return best;
}

// Why the cache file cannot be used for `key`, or "" when it can.
std::string cache_problem(const fs::path& path, const json& key, const Config& cfg, const ModelShape& shape) {
  if (!fs::exists(path)) {
    const std::string closest = closest_cached_key(path.parent_path(), key);
    return closest.empty() ? fmt::format("no cached profile for this key in '{}'", path.parent_path().string())
                           : fmt::format("no cached profile for this key; the closest cached one, {}", closest);
  }
  json doc;
  try {
    doc = json::parse(read_text(path));
  } catch (const json::exception& e) {
    return fmt::format("cache file '{}' is corrupt (not valid JSON: {})", path.string(), e.what());
  }
  if (!doc.is_object() || !doc.contains("cache_key") || doc["cache_key"] != key) {
    const json there = doc.is_object() && doc.contains("cache_key") ? doc["cache_key"] : json();
    return fmt::format("cache file '{}' was written for another key: {}", path.string(),
                       fmt::join(key_differences(there, key), "; "));
  }
  try {
    const DeviceSpec device = DeviceSpec::from_profile(path.string());
    memory_model_for(path.string(), shape, device, cfg.memory, 0);
  } catch (const std::exception& e) {
    return fmt::format("cache file '{}' is corrupt: {}", path.string(), e.what());
  }
  return "";
}

// Every rank's folder must take the profile (rank 0 writes it, the others a copy): checked before anything is
// measured. Throws ConfigError naming this rank's folder, or the rank that cannot write its own.
void check_cache_folder(const std::string& dir, const Communicator& world) {
  const std::string problem = folder_write_problem(dir);
  auto failing = torch::tensor({problem.empty() ? int64_t{-1} : world.rank()}, torch::kInt64);
  world.allreduce_max(failing);
  if (failing.item<int64_t>() < 0) return;
  throw ConfigError(
      problem.empty()
          ? fmt::format("train.profile_dir: rank {} cannot write its profile cache folder (its log names it)",
                        failing.item<int64_t>())
          : fmt::format("train.profile_dir: {}; train.cost_model auto caches the profile there (set "
                        "train.profile_dir to a writable folder, or train.cost_model to a profile file)",
                        problem));
}

// Rank 0 takes `lock`; the others wait with it, in collectives of a second each (a rank blocked in one long
// collective would hit dist.timeout_s while another run profiles).
void wait_for_lock(std::optional<FileLock>& lock, const Communicator& world) {
  for (bool announced = false;; announced = true) {
    auto waiting = torch::tensor({static_cast<int64_t>(lock && !lock->try_lock())}, torch::kInt64);
    world.allreduce_max(waiting);
    if (waiting.item<int64_t>() == 0) return;
    if (lock && !announced) {
      spdlog::info("train.cost_model auto: another run holds '{}' (it is profiling for this key); waiting for "
                   "it, then using its profile",
                   lock->path());
    }
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
}

// Rank 0's text on every rank (rank 0 passes it, the others get it).
std::string share_text(const std::string& text, const Communicator& world) {
  auto size = torch::tensor({static_cast<int64_t>(world.rank() == 0 ? text.size() : 0)}, torch::kInt64);
  world.allreduce_max(size);
  auto bytes = torch::zeros({size.item<int64_t>()}, torch::kInt32);
  if (world.rank() == 0) {
    auto* p = bytes.data_ptr<int32_t>();
    for (size_t i = 0; i < text.size(); ++i) p[i] = static_cast<unsigned char>(text[i]);
  }
  world.allreduce_sum(bytes);
  std::string out(static_cast<size_t>(bytes.numel()), '\0');
  const auto* p = bytes.data_ptr<int32_t>();
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<char>(p[i]);
  return out;
}

}  // namespace

std::string profile_cache_dir(const TrainConfig& train) {
  if (!train.profile_dir.empty()) return train.profile_dir;
  if (auto d = env_or_empty("DCP_CACHE_DIR"); !d.empty()) return d;
  if (auto d = env_or_empty("XDG_CACHE_HOME"); !d.empty()) return (fs::path(d) / "dcp").string();
  if (auto d = env_or_empty("HOME"); !d.empty()) return (fs::path(d) / ".cache" / "dcp").string();
  return ".dcp-cache";
}

json profile_cache_key(const Config& cfg, const ModelShape& shape, int64_t threads, const DistEnv& env) {
  return {{"dcp_version", DCP_VERSION},
          {"hidden", shape.hidden},
          {"layers", shape.layers},
          {"heads", shape.heads},
          {"ffn", shape.ffn},
          {"mlp_matrices", shape.mlp_matrices},
          {"vocab", shape.vocab},
          {"attention", attention_kind_name(shape.attention)},
          // The softmax operator and its tiles change the measured times (reference vs tiled: up to 24x).
          {"attention_impl", cfg.attention.impl},
          // Flexformer's fused kernel and its autograd twin differ in time and memory likewise.
          {"linear_impl", cfg.attention.backend == "flexformer" ? cfg.attention.linear_impl : std::string("-")},
          {"tile_q", cfg.attention.tile_q},
          {"tile_k", cfg.attention.tile_k},
          {"feature_dim", shape.feature_dim},
          {"feature_projections", shape.feature_projections},
          {"chunk_size", shape.chunk_size},
          {"precision", precision_of_bytes(shape.bytes_per_element)},
          {"threads_per_rank", threads},
          {"world_size", env.world_size},
          {"local_world_size", env.local_world_size},
          {"max_seq_len", cfg.data.max_seq_len},
          {"profile_max_length", cfg.train.profile_max_length},
          {"micro_batch_tokens", cfg.train.micro_batch_tokens},
          {"sp_sizes", cfg.parallel.sp_sizes},
          // Profiles under `dcp launch` measure the switch between a step's rounds since issue 26.
          {"round_switch", env.world_size > 1}};
}

std::string profile_cache_path(const std::string& dir, const json& key) {
  // FNV-1a's step (util/hash.h) from an offset basis that lacks the standard one's last digit
  // (14695981039346656037): a slip kept on purpose, since changing it would rename every cached profile.
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : key.dump()) {
    h ^= c;
    h *= Fnv1a64::kPrime;
  }
  return (fs::path(dir) / fmt::format("profile-{:016x}.json", h)).string();
}

CachedProfile resolve_cached_profile(const Config& cfg, const ModelShape& shape, const json& key,
                                     const Communicator& world, const std::function<ProfileResult()>& profile) {
  const std::string dir = profile_cache_dir(cfg.train);
  check_cache_folder(dir, world);
  CachedProfile out;
  out.path = profile_cache_path(dir, key);
  const bool lead = world.rank() == 0;
  std::optional<FileLock> lock;  // rank 0's, held from the check through the write
  if (lead) lock.emplace(out.path + ".lock");
  wait_for_lock(lock, world);
  const std::string reason = lead ? cache_problem(out.path, key, cfg, shape) : "";
  auto need = torch::tensor({static_cast<int64_t>(!reason.empty())}, torch::kInt64);
  world.allreduce_max(need);
  out.profiled = need.item<int64_t>() != 0;

  std::string text;
  if (out.profiled) {
    if (lead) spdlog::info("train.cost_model auto: profiling this model on every rank: {}", reason);
    const auto start = std::chrono::steady_clock::now();
    const ProfileResult result = profile();
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (lead) {
      const fs::path tmp = fmt::format("{}.{}.tmp", out.path, getpid());
      write_profile(result, tmp.string());
      json doc = json::parse(read_text(tmp));
      fs::remove(tmp);
      doc["cache_key"] = key;
      text = doc.dump(1) + "\n";
      write_file_atomically(out.path, text, "rank0.");
    }
  } else if (lead) {
    text = read_text(out.path);
  }
  lock.reset();
  text = share_text(text, world);
  if (!lead && (!fs::exists(out.path) || read_text(out.path) != text)) write_file_atomically(out.path, text, fmt::format("rank{}.", world.rank()));
  const json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  out.attention_separated = !(doc.is_object() && doc.contains("fit") && doc["fit"].is_object() &&
                              doc["fit"].value("attention_separated", true) == false);
  return out;
}

}  // namespace dcp
