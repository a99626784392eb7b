// Launcher environment, rendezvous and the process groups of a run (c10d underneath, kept out of this header).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace dcp {

/// Where this process sits in the job, read from the launcher's variables.
struct DistEnv {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  int64_t local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 29500;
  std::string launcher = "none";  ///< torchrun | openmpi | slurm | none
  /// DCP_RESTART_COUNT: how many times `dcp launch --max-restarts` restarted this job's ranks before this start.
  int64_t restart_count = 0;
  /// DCP_USE_AGENT_STORE=1 (set by `dcp launch --max-restarts`): the launcher of node 0 serves the store at
  /// MASTER_ADDR:MASTER_PORT, every rank is its client, and this start's keys live under "dcp/r<restart_count>/"
  /// (a new round of the same store, as torchelastic's agent store).
  bool agent_store = false;

  /// Reads torchrun's RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE, else Open MPI's OMPI_COMM_WORLD_*, else
  /// Slurm's SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID; MASTER_ADDR and MASTER_PORT in all cases (and dcp launch's
  /// DCP_RESTART_COUNT, DCP_USE_AGENT_STORE). Without any of them: a single process. Throws std::runtime_error naming the variable and its value when one is malformed
  /// or inconsistent (rank >= world_size).
  static DistEnv from_environment();
};

/// One process group. With a single member every collective is a no-op.
/// Every collective waits at most the timeout given at creation and throws std::runtime_error (naming the
/// group and the operation) when a peer died or did not answer in time.
class Communicator {
 public:
  struct Impl;
  Communicator(std::string name, int64_t rank, int64_t size, std::shared_ptr<Impl> impl);

  int64_t rank() const { return rank_; }
  int64_t size() const { return size_; }
  const std::string& name() const { return name_; }

  void allreduce_sum(at::Tensor& t) const;  ///< in place, any shape, CPU float/int
  void allreduce_max(at::Tensor& t) const;  ///< in place
  /// Splits `input` [size * n, ...] into `size` equal chunks along dim 0, sends chunk j to member j, and
  /// returns the chunks received, concatenated in member order (same shape and dtype as input; bf16 included,
  /// bit for bit).
  at::Tensor all_to_all(const at::Tensor& input) const;
  void barrier() const;

  /// A point-to-point exchange in flight (see exchange()).
  class Exchange {
   public:
    struct State;
    Exchange() = default;
    explicit Exchange(std::shared_ptr<State> state) : state_(std::move(state)) {}
    /// Waits for the send and the receive (each at most the group's timeout) and returns the tensor received.
    /// Throws std::runtime_error naming the group when a peer died or did not answer in time, std::logic_error
    /// when nothing is in flight (an empty Exchange, or wait() called twice).
    at::Tensor wait();

   private:
    std::shared_ptr<State> state_;
  };
  /// Sends `send` to member `to` and receives a tensor of the same shape and dtype from member `from`, both in
  /// the background (Gloo's transport threads move the bytes while the caller computes: ring attention hides
  /// a block's transfer behind the previous block's attention); any dtype, bf16 bit for bit. Every member must
  /// call exchange() in the same order: the messages are tagged by a per-group counter. With one member, `to`
  /// and `from` are 0 and the result is a copy. Throws std::invalid_argument for a member outside [0, size).
  Exchange exchange(const at::Tensor& send, int64_t to, int64_t from) const;

 private:
  std::string name_;
  int64_t rank_, size_;
  std::shared_ptr<Impl> impl_;
};

/// The SP sizes named by `spec` for `world_size`, ascending, always including 1 and world_size:
/// "pow2" = powers of two dividing world_size, "all" = every divisor, or a comma list such as "1,2,3".
/// Throws ConfigError (a usage error) naming the spec when it is malformed or a size does not divide world_size.
std::vector<int64_t> resolve_sp_sizes(const std::string& spec, int64_t world_size);

/// The SP sizes a model of `heads` attention heads can run with: resolve_sp_sizes(spec, world_size) without
/// those that do not divide `heads` (Ulysses shards the heads over a group), ascending; 1 is always one. Throws
/// like resolve_sp_sizes.
std::vector<int64_t> usable_sp_sizes(const std::string& spec, int64_t world_size, int64_t heads);

/// The run's process groups, created once at start-up: the world, and for each SP size s the aligned block
/// of ranks [k*s, (k+1)*s) that holds this rank. group(s) is a map look-up, no communication. Every group is
/// warmed at creation (an all-reduce, an all-to-all and a ring exchange on each), so that a plan whose rounds
/// switch groups within a step never pays a group's first use inside a step (lazy buffers and connections
/// of a dynamic group are a known first-use spike, anchors-parallel-training.md section 3.2).
class ProcessGroups {
 public:
  /// Rendezvous over a c10d TCPStore at env.master_addr:env.master_port (rank 0 serves it, or the launcher under
  /// env.agent_store) and Gloo groups. `sp_sizes` must divide env.world_size. The rendezvous and the creation of
  /// every group share one deadline, `timeout_s` seconds after the call: each group's members meet in the store
  /// first, with the time left. Throws std::runtime_error when a peer does not join or does not reach a group by
  /// then (naming the rendezvous or the group and the missing members), rank 0 cannot serve the store (a port in
  /// use: said at once), or std::invalid_argument for an SP size that does not divide world_size.
  ProcessGroups(const DistEnv& env, double timeout_s, const std::vector<int64_t>& sp_sizes = {});

  const DistEnv& env() const { return env_; }
  const Communicator& world() const { return *world_; }
  /// Throws std::out_of_range naming the size when no group of that size was created.
  const Communicator& group(int64_t sp_size) const;
  /// The SP sizes group() answers, ascending: 1, world_size and those given at construction.
  std::vector<int64_t> sp_sizes() const;
  double creation_seconds() const { return creation_seconds_; }
  /// Seconds the warm-up of every group took (after creation_seconds()).
  double warm_up_seconds() const { return warm_up_seconds_; }

  /// Under `dcp launch --max-restarts` (DistEnv::agent_store): tells the launchers that the checkpoint of step
  /// `step` is written, so that a restart resumes (a job that fails before its first one restarts from scratch).
  /// Does nothing otherwise; never throws (a failure is logged as a warning).
  void report_checkpoint(int64_t step) const;

  struct AgentLink;  // the launcher's store, under agent_store

 private:
  void warm_up() const;
  DistEnv env_;
  std::shared_ptr<AgentLink> agent_;
  std::shared_ptr<Communicator> world_;
  std::map<int64_t, std::shared_ptr<Communicator>> groups_;
  double creation_seconds_ = 0;
  double warm_up_seconds_ = 0;
};

}  // namespace dcp
