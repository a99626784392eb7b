// train.cost_model auto: the cost and memory model of this machine, profiled on first use and cached by what
// the profile depends on.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>

#include "dcp/config.h"
#include "dcp/cost_model.h"
#include "dcp/dist.h"
#include "profile/profiler.h"

namespace dcp {

/// The folder of cached profiles: train.profile_dir, else $DCP_CACHE_DIR, else $XDG_CACHE_HOME/dcp, else
/// $HOME/.cache/dcp, else .dcp-cache (relative to the working directory).
std::string profile_cache_dir(const TrainConfig& train);

/// What a profile depends on: the model shape (attention kind and its parameters included), the precision's
/// bytes per element, intra-op threads per rank, world_size and local ranks (they share the cores and give the
/// SP groups), data.max_seq_len and train.micro_batch_tokens (they set the grid's sample lengths and micro-batch
/// sizes, ProfileOptions), parallel.sp_sizes (the SP sizes profiled), and the dcp version.
nlohmann::json profile_cache_key(const Config& cfg, const ModelShape& shape, int64_t threads, const DistEnv& env);

/// Where the profile of `key` is cached: <dir>/profile-<16 hex digits of a 64-bit FNV-1a hash of key.dump(), from
/// a nonstandard offset basis (cache.cpp)>.json.
std::string profile_cache_path(const std::string& dir, const nlohmann::json& key);

/// What resolve_cached_profile did.
struct CachedProfile {
  std::string path;       ///< the profile file the run uses (train.cost_model resolved)
  bool profiled = false;  ///< true when this call measured it (no valid cache for the key)
  double seconds = 0;     ///< wall seconds of the profile, 0 when the cache was used
  /// The profile's fit.attention_separated: false when its grid could not tell attention's cost from the linear
  /// layers' and one rate was fitted to all FLOPs (fit_profile_time)
  bool attention_separated = true;
};

/// Resolves train.cost_model auto collectively on `world` (every rank calls it):
/// 1. Every rank checks that it can write the cache folder (folder_write_problem: created when missing, a probe
///    file created and removed), before anything is measured.
/// 2. Rank 0 takes an advisory lock, flock on "<profile file>.lock" (FileLock), and holds it through the check,
///    the profile and the write, so that a second run sharing the folder waits (logged once; its ranks wait in
///    collectives of a second each, never one long enough for dist.timeout_s) and then finds and uses the first
///    run's profile instead of measuring it again.
/// 3. Rank 0 reads the cache file of `key` and checks that it parses, carries this key and yields a DeviceSpec
///    and a MemoryModel of `shape` (DeviceSpec::from_profile, memory_model_for). When it does not, rank 0 logs
///    why before profiling: no cache file (and the fields in which the closest cache file of the folder
///    differs), a corrupt one (its error), or one of another key (the fields that differ).
/// 4. The verdict is shared; when the cache is missing or not valid every rank runs `profile` (which may use
///    collectives) and rank 0 writes the result with the key to the cache (write_profile; then the key is added,
///    written to a temporary file and renamed, so a crash never leaves a half-written cache).
/// The file's text is then sent from rank 0 to every rank and written where a rank's copy differs (hosts without
/// a shared folder), so every rank plans with the same model. Throws ConfigError (exit 2) when a rank cannot
/// write the folder (naming it, or the rank), std::runtime_error naming the file when the lock file cannot be
/// opened or the profile cannot be written, and what `profile` throws.
CachedProfile resolve_cached_profile(const Config& cfg, const ModelShape& shape, const nlohmann::json& key,
                                     const Communicator& world, const std::function<ProfileResult()>& profile);

}  // namespace dcp
