#include <fmt/format.h>

#include <chrono>

#include "dcp/dist.h"
#include "dist/c10d_compat.h"

namespace dcp {

ProcessGroups::ProcessGroups(const DistEnv& env, double timeout_s, const std::vector<int64_t>& sp_sizes) : env_(env) {
  auto start = std::chrono::steady_clock::now();
  for (int64_t s : sp_sizes) {
    if (s < 1 || env.world_size % s != 0) {
      throw std::invalid_argument(fmt::format("sp_size {} does not divide world_size {}", s, env.world_size));
    }
  }
  if (env.world_size == 1) {
    world_ = std::make_shared<Communicator>("world", 0, 1, nullptr);
  } else {
    auto store = make_tcp_store(env, timeout_s);
    world_ = make_gloo_communicator(store, "world", env.rank, env.world_size, timeout_s);
    // Every rank creates the groups in the same order; each joins only its own block.
    for (int64_t s : sp_sizes) {
      if (s == env.world_size || groups_.count(s)) continue;
      int64_t block = env.rank / s;
      groups_[s] = make_gloo_communicator(store, fmt::format("sp{}_block{}", s, block), env.rank % s, s, timeout_s);
    }
  }
  groups_[env.world_size] = world_;
  if (!groups_.count(1)) groups_[1] = std::make_shared<Communicator>("self", 0, 1, nullptr);
  creation_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

const Communicator& ProcessGroups::group(int64_t sp_size) const {
  auto it = groups_.find(sp_size);
  if (it == groups_.end()) {
    throw std::out_of_range(fmt::format("no process group of sp_size {} was created (world_size {})", sp_size,
                                        env_.world_size));
  }
  return *it->second;
}

}  // namespace dcp
