// Every c10d call whose API differs between LibTorch 1.13 (Debian) and 2.x (CUDA machines) lives here.
#include "dist/c10d_compat.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>

#include <unistd.h>

#include "dcp/dist.h"
#include "util/error_message.h"

namespace dcp {

struct Communicator::Impl {
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;
  double timeout_s = 0;
  mutable std::atomic<uint32_t> next_tag{0};  // the same sequence on every member: see exchange()
};

struct Communicator::Exchange::State {
  const Communicator* group = nullptr;
  at::Tensor sent, received;  // the Works keep their own references too
  bool bf16 = false;
  c10::intrusive_ptr<c10d::Work> send, recv;
};

namespace {

void wait(const Communicator& c, const c10::intrusive_ptr<c10d::Work>& work, const char* op) {
  try {
    work->wait();
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("{} on process group '{}' (rank {} of {}) failed: a peer died or did not "
                                         "answer within the timeout ({})",
                                         op, c.name(), c.rank(), c.size(), error_message(e)));
  }
}

std::chrono::milliseconds to_ms(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

}  // namespace

Communicator::Communicator(std::string name, int64_t rank, int64_t size, std::shared_ptr<Impl> impl)
    : name_(std::move(name)), rank_(rank), size_(size), impl_(std::move(impl)) {}

void Communicator::allreduce_sum(at::Tensor& t) const {
  if (!impl_) return;
  std::vector<at::Tensor> v{t};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::SUM;
  wait(*this, impl_->pg->allreduce(v, o), "allreduce(sum)");
}

void Communicator::allreduce_max(at::Tensor& t) const {
  if (!impl_) return;
  std::vector<at::Tensor> v{t};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp::MAX;
  wait(*this, impl_->pg->allreduce(v, o), "allreduce(max)");
}

at::Tensor Communicator::all_to_all(const at::Tensor& input) const {
  if (!impl_) return input.clone();
  if (input.size(0) % size_ != 0) {
    throw std::invalid_argument(fmt::format("all_to_all on '{}': dim 0 ({}) is not divisible by the group size {}",
                                            name_, input.size(0), size_));
  }
  // Gloo of LibTorch 1.13 has no bf16 ("Invalid scalar type"); an all-to-all only moves bytes, so bf16 travels
  // bit for bit as fp16, which it has.
  const bool bf16 = input.scalar_type() == at::kBFloat16;
  at::Tensor in = bf16 ? input.contiguous().view(at::kHalf) : input.contiguous();
  at::Tensor out = at::empty_like(in);
  std::vector<int64_t> splits;  // empty = equal splits
  wait(*this, impl_->pg->alltoall_base(out, in, splits, splits), "all_to_all");
  return bf16 ? out.view(at::kBFloat16) : out;
}

Communicator::Exchange Communicator::exchange(const at::Tensor& send, int64_t to, int64_t from) const {
  if (to < 0 || to >= size_ || from < 0 || from >= size_) {
    throw std::invalid_argument(fmt::format("exchange on '{}': member {} or {} outside [0, {})", name_, to, from,
                                            size_));
  }
  auto state = std::make_shared<Exchange::State>();
  state->group = this;
  if (!impl_) {
    state->received = send.clone();
    return Exchange(std::move(state));
  }
  // Gloo of LibTorch 1.13 has no bf16; the bytes travel as fp16 (as in all_to_all).
  state->bf16 = send.scalar_type() == at::kBFloat16;
  state->sent = state->bf16 ? send.contiguous().view(at::kHalf) : send.contiguous();
  state->received = at::empty_like(state->sent);
  // Tags stay below 2^31 (c10d takes an int); members wrap at the same call.
  const int tag = static_cast<int>(impl_->next_tag.fetch_add(1) & 0x7fffffffu);
  std::vector<at::Tensor> out{state->sent}, in{state->received};
  try {
    state->recv = impl_->pg->recv(in, static_cast<int>(from), tag);
    state->send = impl_->pg->send(out, static_cast<int>(to), tag);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("exchange on process group '{}' (rank {} of {}, to {}, from {}) failed: {}",
                                         name_, rank_, size_, to, from, error_message(e)));
  }
  return Exchange(std::move(state));
}

at::Tensor Communicator::Exchange::wait() {
  if (!state_) throw std::logic_error("Communicator::Exchange::wait: nothing in flight");
  auto state = std::move(state_);
  if (state->send) {
    const auto timeout = to_ms(state->group->impl_->timeout_s);
    for (auto* work : {&state->send, &state->recv}) {
      std::string why;
      try {
        if (!(*work)->wait(timeout)) why = "aborted";
      } catch (const std::exception& e) {
        why = error_message(e);
      }
      if (!why.empty()) {
        throw std::runtime_error(fmt::format(
            "{} on process group '{}' (rank {} of {}) failed: a peer died or did not answer within the timeout ({})",
            work == &state->send ? "send" : "receive", state->group->name(), state->group->rank(),
            state->group->size(), why));
      }
    }
  }
  return state->bf16 ? state->received.view(at::kBFloat16) : state->received;
}

void Communicator::barrier() const {
  if (!impl_) return;
  wait(*this, impl_->pg->barrier(), "barrier");
}

namespace {

bool port_in_use(const std::string& text) {
  return text.find("Address already in use") != std::string::npos || text.find("errno: 98") != std::string::npos;
}

std::chrono::milliseconds left_until(std::chrono::steady_clock::time_point deadline) {
  return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()),
                  std::chrono::milliseconds(1));
}

}  // namespace

std::string agent_round_prefix(int64_t restart_count) { return fmt::format("dcp/r{}", restart_count); }  // PrefixStore adds "/"

Rendezvous make_tcp_store(const DistEnv& env, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + to_ms(timeout_s);
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(env.master_port);
  o.isServer = env.rank == 0 && !env.agent_store;  // under dcp launch --max-restarts the launcher serves it
  o.numWorkers = static_cast<size_t>(env.world_size);
  // LibTorch 1.13's own wait for workers gives up silently on the server after the timeout, and the Gloo
  // rendezvous then waits a second timeout for the missing peer (2 x timeout_s in all): count the ranks here,
  // against one deadline, instead.
  o.waitWorkers = false;
  o.timeout = to_ms(timeout_s);
  Rendezvous r;
  try {
    r.agent = c10::make_intrusive<c10d::TCPStore>(env.master_addr, o);
  } catch (const std::exception& e) {
    const std::string why = error_message(e);
    if (o.isServer && port_in_use(why)) {
      throw std::runtime_error(fmt::format(
          "rendezvous at {}:{}: rank 0 cannot serve the store: port {} is in use on this host (another job, or a "
          "rank of an earlier run still running?); choose another MASTER_PORT (dcp launch --master-port): {}",
          env.master_addr, env.master_port, env.master_port, why));
    }
    throw std::runtime_error(fmt::format(
        "rendezvous at {}:{} failed for rank {} of {} within {} s (is every rank started, and is the port free?): {}",
        env.master_addr, env.master_port, env.rank, env.world_size, timeout_s, why));
  }
  // Under the launcher's store, this start's keys live in a round of their own: a restart meets its peers anew.
  r.store = r.agent;
  if (env.agent_store) r.store = c10::make_intrusive<c10d::PrefixStore>(agent_round_prefix(env.restart_count), r.agent);
  if (!env.agent_store) r.agent.reset();
  const auto& store = r.store;
  // One key per rank, and wait() for all of them: wait() is the store call that has a receive timeout, so a
  // rank 0 that is stopped (SIGSTOP) cannot hold the others past the deadline; add() and check() would block.
  std::vector<std::string> keys;
  for (int64_t rank = 0; rank < env.world_size; ++rank) keys.push_back(fmt::format("dcp/joined/{}", rank));
  try {
    store->set(keys[static_cast<size_t>(env.rank)], std::vector<uint8_t>{1});
    store->wait(keys, left_until(deadline));
  } catch (const std::exception& e) {
    std::string who;
    if (env.rank == 0 && !env.agent_store) {  // rank 0 serves the store itself, so asking it which keys exist cannot block
      std::vector<int64_t> missing;
      for (int64_t rank = 0; rank < env.world_size; ++rank) {
        if (!store->check({keys[static_cast<size_t>(rank)]})) missing.push_back(rank);
      }
      const int64_t joined = env.world_size - static_cast<int64_t>(missing.size());
      who = fmt::format("only {} of {} ranks joined (missing: {})", joined, env.world_size, fmt::join(missing, ", "));
    } else {
      who = fmt::format("not all {} ranks joined (or the store's host did not answer)", env.world_size);
    }
    throw std::runtime_error(fmt::format(
        "rendezvous at {}:{}: {} within {} s (this is rank {}; is every rank started, with the same MASTER_ADDR, "
        "MASTER_PORT and WORLD_SIZE?): {}",
        env.master_addr, env.master_port, who, timeout_s, env.rank, error_message(e)));
  }
  return r;
}

void meet_in_store(const c10::intrusive_ptr<c10d::Store>& store, const std::string& name, int64_t rank, int64_t size,
                   std::chrono::steady_clock::time_point deadline, double timeout_s) {
  if (size == 1) return;
  std::vector<std::string> keys;
  for (int64_t m = 0; m < size; ++m) keys.push_back(fmt::format("dcp/group/{}/{}", name, m));
  try {
    store->set(keys[static_cast<size_t>(rank)], std::vector<uint8_t>{1});
    if (std::chrono::steady_clock::now() >= deadline) throw std::runtime_error("no time left");
    store->wait(keys, left_until(deadline));
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("creating process group '{}' (rank {} of {}) failed: not every member "
                                         "reached it within dist.timeout_s {} s of the start of the rendezvous (a "
                                         "peer died or stopped after joining): {}",
                                         name, rank, size, timeout_s, error_message(e)));
  }
}

void report_to_agent(const c10::intrusive_ptr<c10d::Store>& agent, const std::string& key, const std::string& value) {
  agent->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

c10::intrusive_ptr<c10d::Store> make_agent_store(const std::string& host, int port, bool serve, double timeout_s) {
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(port);
  o.isServer = serve;
  o.waitWorkers = false;
  o.timeout = to_ms(timeout_s);
  try {
    auto store = c10::make_intrusive<c10d::TCPStore>(host, o);
    // LibTorch 1.13: check(), add() and compareSet() have no timeout of their own (they block while the server is
    // unreachable), but the receive timeout that wait() sets on the client's socket stays: one wait() on a key that
    // exists bounds every later operation of this client by timeout_s.
    const std::string hello = fmt::format("dcp/launch/hello/{}", getpid());
    store->set(hello, std::vector<uint8_t>{1});
    store->wait({hello}, o.timeout);
    return store;
  } catch (const std::exception& e) {
    const std::string why = error_message(e);
    if (serve && port_in_use(why)) {
      throw std::runtime_error(fmt::format("--master-port {}: the port is in use on this host (another job, or an "
                                           "earlier launch still running?): {}",
                                           port, why));
    }
    throw std::runtime_error(fmt::format("{} the launchers' store at {}:{} failed: {}",
                                         serve ? "serving" : "connecting to", host, port, why));
  }
}

struct GlooDevices {
  std::vector<std::shared_ptr<::gloo::transport::Device>> devices;
};

std::shared_ptr<GlooDevices> make_gloo_devices(const GlooBinding& binding) {
  auto out = std::make_shared<GlooDevices>();
  const std::string what = binding.interfaces.empty() ? fmt::format("address {}", binding.address)
                                                      : fmt::format("interface(s) {}", fmt::join(binding.interfaces, ","));
  try {
    for (const auto& name : binding.interfaces) {
      out->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
    }
    if (binding.interfaces.empty()) {
      out->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(binding.address));
    }
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("Gloo cannot bind to {} (chosen by {}): {}", what, binding.reason,
                                         error_message(e)));
  }
  return out;
}

std::shared_ptr<Communicator> make_gloo_communicator(const c10::intrusive_ptr<c10d::Store>& store,
                                                     const std::shared_ptr<GlooDevices>& devices,
                                                     const std::string& name, int64_t rank, int64_t size,
                                                     double timeout_s) {
  if (size == 1) return std::make_shared<Communicator>(name, 0, 1, nullptr);
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(name, store);
  auto opts = c10d::ProcessGroupGloo::Options::create(to_ms(timeout_s));
  opts->devices = devices->devices;
  opts->threads = 1;
  auto impl = std::make_shared<Communicator::Impl>();
  impl->timeout_s = timeout_s;
  try {
    impl->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(prefixed, static_cast<int>(rank), static_cast<int>(size),
                                                           opts);
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("creating process group '{}' (rank {} of {}) failed within {} s: {}", name,
                                         rank, size, timeout_s, error_message(e)));
  }
  return std::make_shared<Communicator>(name, rank, size, std::move(impl));
}

}  // namespace dcp
