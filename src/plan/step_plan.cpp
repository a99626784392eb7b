#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <type_traits>
#include <unordered_map>

#include "dcp/plan.h"

namespace dcp {
namespace {

using nlohmann::json;

json group_json(const GroupPlan& g) {
  json mbs = json::array();
  for (const auto& mb : g.micro_batches) {
    mbs.push_back({{"sample_ids", mb.sample_ids},
                   {"num_tokens", mb.num_tokens},
                   {"recompute_layers", mb.recompute_layers}});
  }
  json jg = {{"first_rank", g.first_rank}, {"sp_size", g.sp_size}, {"micro_batches", mbs}};
  // Absent = ulysses, so that plans written before ring modes keep their JSON and hash.
  if (g.sp_mode != SpMode::kUlysses) jg["sp_mode"] = sp_mode_name(g.sp_mode);
  if (g.sp_mode == SpMode::kUlyssesRing) jg["ulysses_size"] = g.ulysses_size;
  return jg;
}

json to_json_value(const StepPlan& p) {
  json out = {{"epoch", p.epoch}, {"index", p.index}, {"global_num_tokens", p.global_num_tokens}};
  const int64_t rounds = p.num_rounds();
  if (rounds <= 1) {
    // One round: the top-level "groups" of every plan written before rounds, so its JSON and hash stay.
    json groups = json::array();
    for (const auto& g : p.groups) groups.push_back(group_json(g));
    out["groups"] = std::move(groups);
    return out;
  }
  json jr = json::array();
  for (int64_t r = 0; r < rounds; ++r) jr.push_back({{"groups", json::array()}});
  for (const auto& g : p.groups) {
    // A negative round is kept in the text (as round 0's) only for validate() to name; plans never hold one.
    jr[static_cast<size_t>(std::max<int64_t>(g.round, 0))]["groups"].push_back(group_json(g));
  }
  out["rounds"] = std::move(jr);
  return out;
}

template <class T>
T field(const json& j, const char* name, const std::string& where) {
  if (!j.is_object() || !j.contains(name)) {
    throw std::invalid_argument(fmt::format("step plan: missing field '{}' in {}", name, where));
  }
  // nlohmann converts 2.5 to 2 and 1e300 to an undefined value: integer fields must be JSON integers.
  const json& v = j.at(name);
  bool integers = true;
  if constexpr (std::is_same_v<T, int64_t>) integers = v.is_number_integer();
  if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    integers = !v.is_array() || std::all_of(v.begin(), v.end(), [](const json& x) { return x.is_number_integer(); });
  }
  if (!integers || (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))) {
    throw std::invalid_argument(
        fmt::format("step plan: field '{}' in {} is malformed: {} is not a 64-bit JSON integer", name, where, v.dump()));
  }
  try {
    return v.get<T>();
  } catch (const json::exception& e) {
    throw std::invalid_argument(fmt::format("step plan: field '{}' in {} is malformed: {}", name, where, e.what()));
  }
}

GroupPlan group_from_json(const json& jg, const std::string& where, int64_t round) {
  GroupPlan g;
  g.round = round;
  g.first_rank = field<int64_t>(jg, "first_rank", where + " group");
  g.sp_size = field<int64_t>(jg, "sp_size", where + " group");
  std::string gwhere = fmt::format("{} group at rank {}", where, g.first_rank);
  if (jg.contains("sp_mode")) {
    const auto name = field<std::string>(jg, "sp_mode", gwhere);
    try {
      g.sp_mode = sp_mode_from_name(name);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(fmt::format("step plan: field 'sp_mode' in {}: {}", gwhere, e.what()));
    }
  }
  // Read whenever present, so that validate() names one that does not belong to the mode.
  if (jg.contains("ulysses_size")) g.ulysses_size = field<int64_t>(jg, "ulysses_size", gwhere);
  for (const auto& jm : field<json>(jg, "micro_batches", gwhere)) {
    MicroBatch mb;
    mb.sample_ids = field<std::vector<int64_t>>(jm, "sample_ids", gwhere + " micro_batch");
    mb.num_tokens = field<int64_t>(jm, "num_tokens", gwhere + " micro_batch");
    if (jm.contains("recompute_layers")) {
      mb.recompute_layers = field<int64_t>(jm, "recompute_layers", gwhere + " micro_batch");
    }
    g.micro_batches.push_back(std::move(mb));
  }
  return g;
}

// A JSON list (field `name` of `where`); anything else is malformed.
json list_field(const json& j, const char* name, const std::string& where) {
  json v = field<json>(j, name, where);
  if (!v.is_array()) {
    throw std::invalid_argument(
        fmt::format("step plan: field '{}' in {} is malformed: {} is not a list", name, where, v.dump()));
  }
  return v;
}

StepPlan from_json_value(const json& j) {
  StepPlan p;
  p.epoch = field<int64_t>(j, "epoch", "step");
  p.index = field<int64_t>(j, "index", "step");
  p.global_num_tokens = field<int64_t>(j, "global_num_tokens", "step");
  std::string where = fmt::format("step (epoch {}, index {})", p.epoch, p.index);
  const bool has_rounds = j.contains("rounds");
  if (has_rounds && j.contains("groups")) {
    throw std::invalid_argument(fmt::format(
        "step plan: {} has both 'groups' and 'rounds' (one round is a top-level 'groups' list; several are "
        "'rounds': [{{\"groups\": [...]}}, ...])",
        where));
  }
  if (!has_rounds) {
    for (const auto& jg : field<json>(j, "groups", where)) p.groups.push_back(group_from_json(jg, where, 0));
    return p;
  }
  const json& rounds = list_field(j, "rounds", where);
  if (rounds.empty()) throw std::invalid_argument(fmt::format("step plan: field 'rounds' in {} is empty", where));
  for (size_t r = 0; r < rounds.size(); ++r) {
    const std::string rwhere = fmt::format("{} round {}", where, r);
    const json groups = list_field(rounds[r], "groups", rwhere);
    if (groups.empty()) {
      throw std::invalid_argument(
          fmt::format("step plan: {} has no group (the groups of a round partition the ranks)", rwhere));
    }
    for (const auto& jg : groups) p.groups.push_back(group_from_json(jg, rwhere, static_cast<int64_t>(r)));
  }
  return p;
}

}  // namespace

SpLayout GroupPlan::layout() const {
  switch (sp_mode) {
    case SpMode::kUlysses: return {sp_size, sp_size};
    case SpMode::kRing: return {sp_size, 1};
    case SpMode::kUlyssesRing:
      // validate() says this with the plan's position; here it guards every other caller against a division by 0.
      if (ulysses_size < 1 || ulysses_size > sp_size || sp_size % ulysses_size != 0) {
        throw std::invalid_argument(fmt::format("group at rank {}: ulysses-ring with sp_size {} and ulysses_size {}",
                                                first_rank, sp_size, ulysses_size));
      }
      return {sp_size, ulysses_size};
  }
  return {sp_size, sp_size};
}

std::vector<int64_t> StepPlan::sample_ids() const {
  std::vector<int64_t> ids;
  for (const auto& g : groups) {
    for (const auto& mb : g.micro_batches) ids.insert(ids.end(), mb.sample_ids.begin(), mb.sample_ids.end());
  }
  return ids;
}

int64_t StepPlan::num_rounds() const {
  int64_t last = 0;
  for (const auto& g : groups) last = std::max(last, g.round);
  return last + 1;
}

const GroupPlan& StepPlan::group_of(int64_t rank, int64_t round) const {
  for (const auto& g : groups) {
    if (g.round == round && rank >= g.first_rank && rank < g.first_rank + g.sp_size) return g;
  }
  if (num_rounds() == 1 && round == 0) {
    throw std::out_of_range(fmt::format("step plan (epoch {}, index {}) has no group for rank {}", epoch, index, rank));
  }
  throw std::out_of_range(
      fmt::format("step plan (epoch {}, index {}) has no group for rank {} in round {}", epoch, index, rank, round));
}

void StepPlan::validate(int64_t world_size, const std::vector<Sample>& samples, int64_t n_layers) const {
  auto fail = [&](const std::string& what) {
    throw std::invalid_argument(fmt::format("step plan (epoch {}, index {}): {}", epoch, index, what));
  };
  const int64_t rounds = num_rounds();
  // A one-round plan's messages are those of plans before rounds; with several, each names its round.
  auto in_round = [&](int64_t round, const std::string& what) {
    return rounds > 1 ? fmt::format("round {}: {}", round, what) : what;
  };
  for (size_t i = 0; i < groups.size(); ++i) {
    const GroupPlan& g = groups[i];
    if (g.round < 0) fail(fmt::format("the group at rank {} has round {} (rounds count from 0)", g.first_rank, g.round));
    if (i > 0 && g.round < groups[i - 1].round) {
      fail(fmt::format("the group at rank {} of round {} is listed after a group of round {} (groups are listed by "
                       "round)",
                       g.first_rank, g.round, groups[i - 1].round));
    }
  }
  std::vector<int64_t> groups_in_round(static_cast<size_t>(rounds), 0);
  for (const auto& g : groups) ++groups_in_round[static_cast<size_t>(g.round)];
  for (int64_t r = 0; r < rounds; ++r) {
    if (groups_in_round[static_cast<size_t>(r)] == 0 && !groups.empty()) {
      fail(fmt::format("round {} has no group (the groups of a round partition the ranks)", r));
    }
  }
  std::vector<int> covered(static_cast<size_t>(world_size), 0);
  int64_t total = 0;
  // Where each sample id was first seen: a sample trains at most once per step, over all rounds.
  struct Place {
    int64_t round, first_rank;
    size_t micro_batch;
  };
  std::unordered_map<int64_t, Place> placed;
  auto where = [&](const Place& p) {
    return rounds > 1 ? fmt::format("micro_batch {} of the group at rank {} in round {}", p.micro_batch, p.first_rank,
                                    p.round)
                      : fmt::format("micro_batch {} of the group at rank {}", p.micro_batch, p.first_rank);
  };
  auto check_covered = [&](int64_t round) {
    for (int64_t r = 0; r < world_size; ++r) {
      if (!covered[static_cast<size_t>(r)]) fail(in_round(round, fmt::format("rank {} is in no group", r)));
    }
    std::fill(covered.begin(), covered.end(), 0);
  };
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const GroupPlan& g = groups[gi];
    if (gi > 0 && g.round != groups[gi - 1].round) check_covered(groups[gi - 1].round);
    auto fail_here = [&](const std::string& what) { fail(in_round(g.round, what)); };
    if (g.sp_size < 1 || g.first_rank < 0 || g.first_rank + g.sp_size > world_size) {
      fail_here(
          fmt::format("group [{}, {}) is outside world_size {}", g.first_rank, g.first_rank + g.sp_size, world_size));
    }
    if (g.first_rank % g.sp_size != 0) {
      fail_here(fmt::format("group at rank {} with sp_size {} is not aligned", g.first_rank, g.sp_size));
    }
    const bool ulysses_ring = g.sp_mode == SpMode::kUlyssesRing;
    if (ulysses_ring && (g.ulysses_size <= 1 || g.ulysses_size >= g.sp_size || g.sp_size % g.ulysses_size != 0)) {
      fail_here(fmt::format("group at rank {}: sp_mode ulysses-ring with sp_size {} needs ulysses_size strictly "
                            "between 1 and sp_size that divides it, not {} (use sp_mode ulysses or ring for the ends)",
                            g.first_rank, g.sp_size, g.ulysses_size));
    }
    if (!ulysses_ring && g.ulysses_size != 0) {
      fail_here(fmt::format("group at rank {}: ulysses_size {} is set but sp_mode is {} (only ulysses-ring has one)",
                            g.first_rank, g.ulysses_size, sp_mode_name(g.sp_mode)));
    }
    for (int64_t r = g.first_rank; r < g.first_rank + g.sp_size; ++r) {
      if (covered[static_cast<size_t>(r)]++) fail_here(fmt::format("rank {} is in more than one group", r));
    }
    for (size_t m = 0; m < g.micro_batches.size(); ++m) {
      const MicroBatch& mb = g.micro_batches[m];
      if (mb.sample_ids.empty()) fail_here(fmt::format("a micro_batch of the group at rank {} has no samples", g.first_rank));
      int64_t tokens = 0;
      const Place here{g.round, g.first_rank, m};
      for (int64_t id : mb.sample_ids) {
        if (id < 0 || id >= static_cast<int64_t>(samples.size())) fail_here(fmt::format("unknown sample id {}", id));
        const auto [it, first] = placed.emplace(id, here);
        if (!first) fail(fmt::format("sample id {} is used twice: in {} and in {}", id, where(it->second), where(here)));
        tokens += samples[static_cast<size_t>(id)].length;
      }
      if (tokens != mb.num_tokens) {
        fail_here(fmt::format("micro_batch num_tokens {} but its samples hold {} tokens (do the sample ids refer to "
                              "this corpus and data.max_seq_len?)",
                              mb.num_tokens, tokens));
      }
      if (mb.recompute_layers < 0 || mb.recompute_layers > n_layers) {
        fail_here(fmt::format("recompute_layers {} outside [0, {}]", mb.recompute_layers, n_layers));
      }
      total += tokens;
    }
  }
  check_covered(groups.empty() ? 0 : groups.back().round);
  if (total != global_num_tokens) {
    fail(fmt::format("global_num_tokens {} but micro_batches hold {} tokens", global_num_tokens, total));
  }
}

std::string StepPlan::to_json() const { return to_json_value(*this).dump(); }

StepPlan StepPlan::from_json(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw std::invalid_argument(fmt::format("step plan: not valid JSON: {}", e.what()));
  }
  return from_json_value(j);
}

int64_t StepPlan::hash() const {
  return static_cast<int64_t>(fnv1a64(to_json()) >> 2);
}

std::vector<StepPlan> load_plans(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(fmt::format("plan file '{}' cannot be opened", path));
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    throw std::runtime_error(fmt::format("plan file '{}' is not valid JSON: {}", path, e.what()));
  }
  std::vector<StepPlan> plans;
  try {
    if (j.is_array()) {
      for (const auto& x : j) plans.push_back(from_json_value(x));
    } else {
      plans.push_back(from_json_value(j));
    }
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(fmt::format("plan file '{}': {}", path, e.what()));
  }
  if (plans.empty()) throw std::runtime_error(fmt::format("plan file '{}' holds no step", path));
  return plans;
}

void save_plans(const std::string& path, const std::vector<StepPlan>& plans) {
  json j = json::array();
  for (const auto& p : plans) j.push_back(to_json_value(p));
  std::ofstream out(path);
  if (!out) throw std::runtime_error(fmt::format("plan file '{}' cannot be written", path));
  out << j.dump(1) << "\n";
}

}  // namespace dcp
