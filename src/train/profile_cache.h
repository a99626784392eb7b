// train.cost_model auto: the cost and memory model of this machine, profiled on first use and cached by what
// the profile depends on.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "dcp/config.h"
#include "dcp/cost_model.h"
#include "dcp/dist.h"
#include "dcp/profiler.h"

namespace dcp {

/// The folder of cached profiles: train.profile_dir, else $DCP_CACHE_DIR, else $XDG_CACHE_HOME/dcp, else
/// $HOME/.cache/dcp, else .dcp-cache (relative to the working directory).
std::string profile_cache_dir(const TrainConfig& train);

/// What a profile depends on: the model shape (attention kind and its parameters included), the precision's
/// bytes per element, intra-op threads per rank, world_size and local ranks (they share the cores and give the
/// SP groups), data.max_seq_len and parallel.sp_sizes (they bound the grid), and the dcp version.
nlohmann::json profile_cache_key(const Config& cfg, const ModelShape& shape, int64_t threads, const DistEnv& env);

/// Where the profile of `key` is cached: <dir>/profile-<16 hex digits of a 64-bit FNV-1a hash of key.dump()>.json.
std::string profile_cache_path(const std::string& dir, const nlohmann::json& key);

/// What resolve_cached_profile did.
struct CachedProfile {
  std::string path;     ///< the profile file the run uses (train.cost_model resolved)
  bool profiled = false;  ///< true when this call measured it (no valid cache for the key)
  std::string reason;   ///< why it profiled: no cache file, a corrupt one (named, with the error), another key
  double seconds = 0;   ///< wall seconds of the profile, 0 when the cache was used
};

/// Resolves train.cost_model auto collectively on `world` (every rank calls it): rank 0 reads the cache file of
/// `key` and checks that it parses, carries this key and yields a DeviceSpec and a MemoryModel of `shape`
/// (DeviceSpec::from_profile, memory_model_for); the verdict is shared, and when the cache is missing or not
/// valid every rank runs `profile` (which may use collectives) and rank 0 writes the result with the key to the
/// cache (write_profile; then the key is added, written to a temporary file and renamed, so a crash never leaves a
/// half-written cache). The file's text is then sent from rank 0 to every rank and written where a rank's copy
/// differs (hosts without a shared folder), so every rank plans with the same model. Throws std::runtime_error
/// naming the folder or file when it cannot be created or written, and what `profile` throws.
CachedProfile resolve_cached_profile(const Config& cfg, const ModelShape& shape, const nlohmann::json& key,
                                     const Communicator& world, const std::function<ProfileResult()>& profile);

}  // namespace dcp
