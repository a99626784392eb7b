#include <fmt/format.h>

#include <cstdlib>
#include <stdexcept>

#include "dcp/dist.h"

namespace dcp {
namespace {

bool has(const char* name) { return std::getenv(name) != nullptr; }

int64_t read_int(const char* name, int64_t fallback, int64_t min_value) {
  const char* v = std::getenv(name);
  if (v == nullptr) return fallback;
  std::string s(v);
  size_t used = 0;
  int64_t x = 0;
  try {
    x = std::stoll(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (s.empty() || used != s.size() || x < min_value) {
    throw std::runtime_error(
        fmt::format("environment variable {}='{}' is not an integer >= {}", name, s, min_value));
  }
  return x;
}

}  // namespace

DistEnv DistEnv::from_environment() {
  DistEnv e;
  struct Names {
    const char *launcher, *rank, *world, *local_rank, *local_world;
  };
  const Names kLaunchers[] = {
      {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
      {"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
       "OMPI_COMM_WORLD_LOCAL_SIZE"},
      // SLURM_NTASKS_PER_NODE may read "2(x3)", so Slurm jobs size threads by world_size instead.
      {"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", nullptr},
  };
  for (const auto& n : kLaunchers) {
    if (!has(n.rank)) continue;
    e.launcher = n.launcher;
    e.rank = read_int(n.rank, 0, 0);
    e.world_size = read_int(n.world, 1, 1);
    e.local_rank = read_int(n.local_rank, e.rank, 0);
    e.local_world_size = n.local_world ? read_int(n.local_world, e.world_size, 1) : e.world_size;
    if (e.rank >= e.world_size) {
      throw std::runtime_error(fmt::format("environment: {}={} is not below {}={}", n.rank, e.rank, n.world,
                                           e.world_size));
    }
    break;
  }
  e.restart_count = read_int("DCP_RESTART_COUNT", 0, 0);
  if (const char* a = std::getenv("DCP_USE_AGENT_STORE")) e.agent_store = std::string(a) == "1";
  if (const char* a = std::getenv("MASTER_ADDR")) e.master_addr = a;
  e.master_port = read_int("MASTER_PORT", e.master_port, 1);
  if (e.master_port > 65535) {
    throw std::runtime_error(fmt::format("environment variable MASTER_PORT='{}' is not a port number", e.master_port));
  }
  return e;
}

}  // namespace dcp
