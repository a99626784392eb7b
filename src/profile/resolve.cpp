// resolve_cost_models: train.cost_model resolved on this machine (include/dcp/profile.h).
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "dcp/profile.h"
#include "profile/cache.h"
#include "profile/profiler.h"

namespace dcp {
namespace {

using nlohmann::json;

// A budget below what the model holds before any token (weights, gradients, AdamW moments) admits nothing.
void check_resident_bytes(const MemoryModel& memory) {
  const double resident = memory.coefficients().base_bytes;
  if (memory.budget_bytes() <= resident) {
    throw ConfigError(fmt::format(
        "memory.budget_bytes {:.0f} is below the model's resident bytes {:.0f} (weights, gradients and AdamW "
        "moments, {} memory model): no micro-batch can fit; allow at least {:.0f} bytes plus its activations",
        memory.budget_bytes(), resident, memory.source(), resident));
  }
}

}  // namespace

RunCostModels resolve_cost_models(const Config& cfg, const ModelShape& shape, int64_t threads,
                                  int64_t longest_sample_tokens, const ProcessGroups& groups) {
  if (cfg.train.cost_model == "h200") {
    spdlog::warn("train.cost_model h200: this CPU run is planned with an H200's speeds and {:.0f} GB; its "
                 "predictions and memory budget do not describe this machine (auto profiles it)",
                 DeviceSpec{}.memory_bytes / 1e9);
  }
  std::string source = cfg.train.cost_model;
  if (source == "auto") {
    const DistEnv& env = groups.env();
    const int64_t shortest = min_profile_max_length(cfg.parallel, cfg.model, env.world_size);
    if (cfg.data.max_seq_len < shortest) {
      throw ConfigError(fmt::format("train.cost_model auto: data.max_seq_len {} is below {}, the shortest the "
                                    "profile's grids can be built from with its SP sizes; raise it or give "
                                    "train.cost_model a profile file",
                                    cfg.data.max_seq_len, shortest));
    }
    const int64_t longest = cfg.train.profile_max_length;
    if (longest > 0 && (longest < shortest || longest > cfg.data.max_seq_len)) {
      throw ConfigError(fmt::format("config key 'train.profile_max_length': bad value '{}' (allowed: 0, or a length "
                                    "in [{}, data.max_seq_len {}]: the shortest the profile's grids can be built "
                                    "from with its SP sizes, and no longer than a sample)",
                                    longest, shortest, cfg.data.max_seq_len));
    }
    ProfileOptions options;
    options.max_length = longest;
    const json key = profile_cache_key(cfg, shape, threads, env);
    Config profiled = cfg;
    profiled.train.threads = threads;
    const CachedProfile c = resolve_cached_profile(cfg, shape, key, groups.world(), [&] {
      return profile_model(profiled, &groups, options);
    });
    if (c.profiled) {
      spdlog::info("train.cost_model auto: profiled this model in {:.1f} s; cached at {}", c.seconds, c.path);
    } else {
      spdlog::info("train.cost_model auto: cached profile {} (train.profile_dir; delete it to re-profile)", c.path);
    }
    source = c.path;
    // Say when the profile could not tell attention's cost from the linear layers' (one rate for all FLOPs), as
    // `dcp profile` prints it: the planner then weighs attention like any other FLOP.
    if (!c.attention_separated) {
      spdlog::info("train.cost_model auto: the profile's grid did not separate attention from the linear FLOPs: one "
                   "rate fitted to both (fit.attention_separated false in {})",
                   c.path);
    }
  }
  const DeviceSpec device = DeviceSpec::named(source);
  RunCostModels models{source, CostModel(shape, device),
                       memory_model_for(source, shape, device, cfg.memory, longest_sample_tokens)};
  check_resident_bytes(models.memory);
  return models;
}

}  // namespace dcp
