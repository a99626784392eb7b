// Construction of c10d stores and groups; the only place that names version-specific c10d APIs.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

#include "dcp/dist.h"
#include "dist/gloo_address.h"

namespace dcp {

/// The store of a rendezvous: `store` holds this start's keys; `agent` is the launcher's whole store (under
/// DistEnv::agent_store, where `store` is its rendezvous round's "dcp/r<restart_count>/"), else null.
struct Rendezvous {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Store> agent;
};

/// The key prefix of rendezvous round `restart_count` in the launcher's store.
std::string agent_round_prefix(int64_t restart_count);

/// TCPStore at env.master_addr:env.master_port, served by rank 0 (or, under env.agent_store, by the launcher of
/// node 0, every rank a client). Returns once all env.world_size ranks have joined it; throws std::runtime_error
/// (naming the address, the rank and how many joined) when that takes longer than timeout_s seconds, counted from
/// the call, on every rank; and at once when rank 0 cannot serve it because the port is in use.
Rendezvous make_tcp_store(const DistEnv& env, double timeout_s);

/// Waits in `store` for the `size` members of group `name` (this one is member `rank`) until `deadline`; the
/// creation of a Gloo group then finds every member there. Throws std::runtime_error naming the group and
/// dist.timeout_s `timeout_s` when a member does not come.
void meet_in_store(const c10::intrusive_ptr<c10d::Store>& store, const std::string& name, int64_t rank, int64_t size,
                   std::chrono::steady_clock::time_point deadline, double timeout_s);

/// Sets `key` to `value` in the launcher's store (ProcessGroups::report_checkpoint).
void report_to_agent(const c10::intrusive_ptr<c10d::Store>& agent, const std::string& key, const std::string& value);

/// The launchers' own TCPStore (dcp launch --max-restarts): served on `port` of this host when `serve`, else a
/// client of host:port. Connecting retries for up to timeout_s; get() and wait() time out after timeout_s. Throws
/// std::runtime_error: a port in use (said at once, naming --master-port), or no server within timeout_s.
c10::intrusive_ptr<c10d::Store> make_agent_store(const std::string& host, int port, bool serve, double timeout_s);

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
