#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <sstream>

#include "dcp/config.h"
#include "dcp/dist.h"
#include "dist/c10d_compat.h"
#include "util/clock.h"

namespace dcp {

std::vector<int64_t> resolve_sp_sizes(const std::string& spec, int64_t world_size) {
  std::set<int64_t> sizes{1, world_size};
  if (spec == "pow2" || spec == "all") {
    for (int64_t s = 1; s <= world_size; ++s) {
      bool pow2 = (s & (s - 1)) == 0;
      if (world_size % s == 0 && (spec == "all" || pow2)) sizes.insert(s);
    }
  } else {
    if (spec.empty()) throw ConfigError("config key 'parallel.sp_sizes': empty value (allowed: pow2, all, or a comma list)");
    std::stringstream in(spec);
    for (std::string item; std::getline(in, item, ',');) {
      size_t used = 0;
      int64_t s = 0;
      try {
        s = std::stoll(item, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0 || used != item.size() || s < 1 || world_size % s != 0) {
        throw ConfigError(fmt::format(
            "config key 'parallel.sp_sizes': bad value '{}' (allowed: pow2, all, or a comma list of divisors of "
            "world_size {}; '{}' is not one)",
            spec, world_size, item));
      }
      sizes.insert(s);
    }
  }
  return {sizes.begin(), sizes.end()};
}

std::vector<int64_t> usable_sp_sizes(const std::string& spec, int64_t world_size, int64_t heads) {
  std::vector<int64_t> out;
  for (int64_t s : resolve_sp_sizes(spec, world_size)) {
    if (heads % s == 0) out.push_back(s);
  }
  return out;
}

struct ProcessGroups::AgentLink {
  c10::intrusive_ptr<c10d::Store> store;
};

ProcessGroups::ProcessGroups(const DistEnv& env, double timeout_s, const std::vector<int64_t>& sp_sizes) : env_(env) {
  auto start = std::chrono::steady_clock::now();
  for (int64_t s : sp_sizes) {
    if (s < 1 || env.world_size % s != 0) {
      throw std::invalid_argument(fmt::format("sp_size {} does not divide world_size {}", s, env.world_size));
    }
  }
  if (env.world_size == 1) {
    world_ = std::make_shared<Communicator>("world", 0, 1, nullptr);
    // Under dcp launch --max-restarts a single rank still tells its launcher of its checkpoints.
    if (env.agent_store) agent_ = std::make_shared<AgentLink>(AgentLink{make_tcp_store(env, timeout_s).agent});
  } else {
    // Chosen before the rendezvous, so that a bad GLOO_SOCKET_IFNAME or MASTER_ADDR fails at once.
    const GlooBinding binding = choose_gloo_binding(env.master_addr, std::getenv("GLOO_SOCKET_IFNAME"));
    if (env.local_rank == 0) {  // the same on every rank of a host
      // stderr: the run's logger does not exist yet, and stdout may carry a command's JSON (verify-plan).
      fmt::print(stderr, "dcp [rank {}]: Gloo binds to {} ({})\n", env.rank,
                 binding.interfaces.empty() ? "address " + binding.address
                                            : fmt::format("interface(s) {}", fmt::join(binding.interfaces, ",")),
                 binding.reason);
    }
    auto devices = make_gloo_devices(binding);
    // One deadline for the rendezvous and every group: a peer that joins and then dies or stops must not cost a
    // timeout per group (Gloo waits its full timeout for each).
    const auto deadline = start + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
    Rendezvous rdzv = make_tcp_store(env, timeout_s);
    const auto& store = rdzv.store;
    if (rdzv.agent) agent_ = std::make_shared<AgentLink>(AgentLink{rdzv.agent});
    meet_in_store(store, "world", env.rank, env.world_size, deadline, timeout_s);
    world_ = make_gloo_communicator(store, devices, "world", env.rank, env.world_size, timeout_s);
    // Every rank creates the groups in the same order; each joins only its own block.
    for (int64_t s : sp_sizes) {
      if (s == env.world_size || groups_.count(s)) continue;
      int64_t block = env.rank / s;
      const std::string name = fmt::format("sp{}_block{}", s, block);
      meet_in_store(store, name, env.rank % s, s, deadline, timeout_s);
      groups_[s] = make_gloo_communicator(store, devices, name, env.rank % s, s, timeout_s);
    }
  }
  groups_[env.world_size] = world_;
  if (!groups_.count(1)) groups_[1] = std::make_shared<Communicator>("self", 0, 1, nullptr);
  creation_seconds_ = seconds_since(start);
  const auto warm_start = std::chrono::steady_clock::now();
  warm_up();
  warm_up_seconds_ = seconds_since(warm_start);
}

void ProcessGroups::warm_up() const {
  // Every rank walks the sizes in the same (ascending) order and uses its own block of each: the blocks of one
  // size run side by side, and no rank waits on a group before its members reach it.
  for (const auto& [size, group] : groups_) {
    if (size == 1) continue;
    auto t = torch::ones({size * 4}, torch::kFloat32);
    group->allreduce_sum(t);
    group->all_to_all(t);
    const int64_t r = group->rank();
    group->exchange(t.slice(0, 0, 4).clone(), (r + 1) % size, (r + size - 1) % size).wait();
  }
}

void ProcessGroups::report_checkpoint(int64_t step) const {
  if (!agent_) return;
  try {
    report_to_agent(agent_->store, "dcp/launch/checkpoint_step", std::to_string(step));
  } catch (const std::exception& e) {
    spdlog::warn("cannot tell dcp launch that checkpoint step {} is written: {}", step, e.what());
  }
}

const Communicator& ProcessGroups::group(int64_t sp_size) const {
  auto it = groups_.find(sp_size);
  if (it == groups_.end()) {
    throw std::out_of_range(fmt::format("no process group of sp_size {} was created (world_size {})", sp_size,
                                        env_.world_size));
  }
  return *it->second;
}

std::vector<int64_t> ProcessGroups::sp_sizes() const {
  std::vector<int64_t> sizes;
  for (const auto& entry : groups_) sizes.push_back(entry.first);
  return sizes;
}

}  // namespace dcp
