// Construction of c10d stores and groups; the only place that names version-specific c10d APIs.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "dcp/dist.h"

namespace dcp {

/// TCPStore served by rank 0 at env.master_addr:env.master_port; waits for all ranks up to timeout_s.
c10::intrusive_ptr<c10d::Store> make_tcp_store(const DistEnv& env, double timeout_s);

/// A Gloo group of `size` members over a key space `name` of `store`; size 1 needs no communication.
std::shared_ptr<Communicator> make_gloo_communicator(const c10::intrusive_ptr<c10d::Store>& store,
                                                     const std::string& name, int64_t rank, int64_t size,
                                                     double timeout_s);

}  // namespace dcp
