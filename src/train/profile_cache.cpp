#include "train/profile_cache.h"

#include <fmt/format.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "dcp/planning.h"
#include "dcp/precision.h"
#include "util/file_write.h"

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

// Why the cache file cannot be used for `key`, or "" when it can.
std::string cache_problem(const fs::path& path, const json& key, const Config& cfg, const ModelShape& shape) {
  if (!fs::exists(path)) return "no cached profile for this key";
  json doc;
  try {
    doc = json::parse(read_text(path));
  } catch (const json::exception& e) {
    return fmt::format("cache file '{}' is corrupt (not valid JSON: {})", path.string(), e.what());
  }
  if (!doc.is_object() || !doc.contains("cache_key") || doc["cache_key"] != key) {
    return fmt::format("cache file '{}' was written for another key ({})", path.string(),
                       doc.is_object() && doc.contains("cache_key") ? doc["cache_key"].dump() : "none");
  }
  try {
    const DeviceSpec device = DeviceSpec::from_profile(path.string());
    memory_model_for(path.string(), shape, device, cfg.memory, 0);
  } catch (const std::exception& e) {
    return fmt::format("cache file '{}' is corrupt: {}", path.string(), e.what());
  }
  return "";
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
          {"feature_dim", shape.feature_dim},
          {"feature_projections", shape.feature_projections},
          {"chunk_size", shape.chunk_size},
          {"precision", precision_of_bytes(shape.bytes_per_element)},
          {"threads_per_rank", threads},
          {"world_size", env.world_size},
          {"local_world_size", env.local_world_size},
          {"max_seq_len", cfg.data.max_seq_len},
          {"sp_sizes", cfg.parallel.sp_sizes}};
}

std::string profile_cache_path(const std::string& dir, const json& key) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a, 64 bit: stable across builds, unlike std::hash
  for (unsigned char c : key.dump()) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return (fs::path(dir) / fmt::format("profile-{:016x}.json", h)).string();
}

CachedProfile resolve_cached_profile(const Config& cfg, const ModelShape& shape, const json& key,
                                     const Communicator& world, const std::function<ProfileResult()>& profile) {
  const std::string dir = profile_cache_dir(cfg.train);
  CachedProfile out;
  out.path = profile_cache_path(dir, key);
  const bool lead = world.rank() == 0;
  if (lead) out.reason = cache_problem(out.path, key, cfg, shape);
  auto need = torch::tensor({static_cast<int64_t>(!out.reason.empty())}, torch::kInt64);
  world.allreduce_max(need);
  out.profiled = need.item<int64_t>() != 0;

  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw std::runtime_error(fmt::format("cannot create the profile cache folder '{}' (train.profile_dir): {}",
                                               dir, ec.message()));
  std::string text;
  if (out.profiled) {
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
  text = share_text(text, world);
  if (!lead && (!fs::exists(out.path) || read_text(out.path) != text)) write_file_atomically(out.path, text, fmt::format("rank{}.", world.rank()));
  return out;
}

}  // namespace dcp
