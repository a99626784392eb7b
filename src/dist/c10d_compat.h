// Construction of c10d stores and groups; the only place that names version-specific c10d APIs.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "dcp/dist.h"
#include "dist/gloo_address.h"

namespace dcp {

/// TCPStore served by rank 0 at env.master_addr:env.master_port. Returns once all env.world_size ranks have
/// joined it; throws std::runtime_error (naming the address, the rank and how many joined) when that takes
/// longer than timeout_s seconds, counted from the call, on every rank.
c10::intrusive_ptr<c10d::Store> make_tcp_store(const DistEnv& env, double timeout_s);

/// The Gloo transport devices of `binding` (one per interface, or one bound to its address), shared by every
/// group of the process. Throws std::runtime_error naming the interface or address when Gloo cannot use it.
struct GlooDevices;
std::shared_ptr<GlooDevices> make_gloo_devices(const GlooBinding& binding);

/// A Gloo group of `size` members over a key space `name` of `store`; size 1 needs no communication.
/// Collectives time out after timeout_s seconds.
std::shared_ptr<Communicator> make_gloo_communicator(const c10::intrusive_ptr<c10d::Store>& store,
                                                     const std::shared_ptr<GlooDevices>& devices,
                                                     const std::string& name, int64_t rank, int64_t size,
                                                     double timeout_s);

}  // namespace dcp
