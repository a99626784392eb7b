// The server's counters, gauges and latency histograms, written as Prometheus text (GET /metrics; the exposition
// format of prometheus.io/docs/instrumenting/exposition_formats). Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace dcp::serve {

/// A cumulative histogram with fixed upper bounds (seconds).
struct Histogram {
  explicit Histogram(std::vector<double> bounds);
  void observe(double x);
  std::vector<double> bounds;
  std::vector<uint64_t> counts;  ///< per bound, then +Inf (not cumulative here; cumulated when written)
  double sum = 0;
  uint64_t count = 0;
};

/// What the scheduler reports about its state when the metrics are written.
struct SchedulerGauges {
  int64_t active = 0, queued = 0;
  int64_t kv_bytes = 0;           ///< KvCache::bytes() of every active session (the caches' own accounting)
  int64_t kv_capacity_bytes = 0;  ///< KvCache::capacity_bytes(): storage allocated
  int64_t kv_held_bytes = 0;      ///< what admission counts: per session max(reservation, bytes)
  int64_t kv_memory_bytes = 0;    ///< serve.kv_memory_bytes
  int64_t peak_active = 0;        ///< the most sessions active at once since start
  uint64_t steps = 0;             ///< scheduler iterations that ran a forward
  double step_seconds = 0;        ///< their seconds (forward, sampling, bookkeeping): the scheduler's busy time
  uint64_t prefill_tokens = 0;    ///< prompt tokens their prefill chunks ran
  /// Of those, the iterations that ran no prefill chunk (every session decoding one token): their number, the
  /// tokens they decoded and their seconds (forward, sampling, bookkeeping): decode throughput without prefill.
  uint64_t decode_steps = 0, decode_step_tokens = 0;
  double decode_step_seconds = 0;
  /// Prefill chunks that PrefillBudget shortened (serve.prefill_step_ratio, serve.prefill_step_ms) and the prompt
  /// tokens they ran.
  uint64_t prefill_chunks_shortened = 0, prefill_shortened_tokens = 0;
  /// Decode-only steps PrefillBudget asked for while a prompt it governs waited (its measure of a decode step).
  uint64_t prefill_budget_decode_steps = 0;
  uint64_t cancelled = 0;         ///< sessions cancelled (client gone or shutdown)
  uint64_t over_reservation = 0;  ///< sessions whose cache grew past their reservation (minimax abstaining)
  /// Saturated time: the scheduler iterations that ran while a request waited in the queue (for KV memory or a
  /// batch slot). Their seconds, and the integrals over them of the sessions held (session-seconds) and of the KV
  /// bytes held (KvCache::bytes, byte-seconds): saturated_session_seconds / saturated_seconds is the mean number of
  /// sessions the server held while it could admit no more, a steadier measure of capacity than the peak.
  double saturated_seconds = 0, saturated_session_seconds = 0, saturated_kv_byte_seconds = 0;
};

class Metrics {
 public:
  Metrics();
  void request(int status);                   ///< a /v1/completions answer, by HTTP status
  void tokens(int64_t prompt, int64_t completion);
  void time_to_first_token(double seconds);
  void inter_token_latency(double seconds);
  void finish(const std::string& reason);     ///< stop | length | cancelled | error
  /// The Prometheus text: these counters and histograms, the gauges, the process's resident memory.
  std::string text(const SchedulerGauges& gauges) const;

 private:
  mutable std::mutex mu_;
  std::map<int, uint64_t> requests_;
  std::map<std::string, uint64_t> finished_;
  uint64_t prompt_tokens_ = 0, completion_tokens_ = 0;
  Histogram ttft_, itl_;
};

/// The process's resident set size in bytes (/proc/self/statm), 0 where it cannot be read.
int64_t resident_bytes();

}  // namespace dcp::serve
