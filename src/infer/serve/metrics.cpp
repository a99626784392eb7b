#include "infer/serve/metrics.h"

#include <fmt/format.h>
#include <unistd.h>

#include <fstream>

namespace dcp::serve {

Histogram::Histogram(std::vector<double> b) : bounds(std::move(b)), counts(bounds.size() + 1, 0) {}

void Histogram::observe(double x) {
  size_t i = 0;
  while (i < bounds.size() && x > bounds[i]) ++i;
  ++counts[i];
  sum += x;
  ++count;
}

Metrics::Metrics()
    : ttft_({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      itl_({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5}) {}

void Metrics::request(int status) {
  std::lock_guard<std::mutex> lock(mu_);
  ++requests_[status];
}

void Metrics::tokens(int64_t prompt, int64_t completion) {
  std::lock_guard<std::mutex> lock(mu_);
  prompt_tokens_ += static_cast<uint64_t>(prompt);
  completion_tokens_ += static_cast<uint64_t>(completion);
}

void Metrics::time_to_first_token(double s) {
  std::lock_guard<std::mutex> lock(mu_);
  ttft_.observe(s);
}

void Metrics::inter_token_latency(double s) {
  std::lock_guard<std::mutex> lock(mu_);
  itl_.observe(s);
}

void Metrics::finish(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  ++finished_[reason];
}

namespace {

void histogram(std::string& out, const char* name, const char* help, const Histogram& h) {
  out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
  uint64_t cum = 0;
  for (size_t i = 0; i < h.bounds.size(); ++i) {
    cum += h.counts[i];
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, h.bounds[i], cum);
  }
  cum += h.counts.back();
  out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, cum, name, h.sum, name, h.count);
}

void gauge(std::string& out, const char* name, const char* type, const char* help, double value) {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n{} {}\n", name, help, name, type, name, value);
}

}  // namespace

std::string Metrics::text(const SchedulerGauges& g) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  out += "# HELP dcp_requests_total Completion requests answered, by HTTP status.\n# TYPE dcp_requests_total counter\n";
  for (const auto& [status, n] : requests_) out += fmt::format("dcp_requests_total{{status=\"{}\"}} {}\n", status, n);
  out += "# HELP dcp_completions_total Sessions finished, by reason.\n# TYPE dcp_completions_total counter\n";
  for (const auto& [reason, n] : finished_) out += fmt::format("dcp_completions_total{{reason=\"{}\"}} {}\n", reason, n);
  gauge(out, "dcp_prompt_tokens_total", "counter", "Prompt tokens (bytes) of admitted requests.", static_cast<double>(prompt_tokens_));
  gauge(out, "dcp_completion_tokens_total", "counter", "Tokens (bytes) generated.", static_cast<double>(completion_tokens_));
  gauge(out, "dcp_sessions_active", "gauge", "Sessions being prefilled or decoded.", static_cast<double>(g.active));
  gauge(out, "dcp_sessions_queued", "gauge", "Requests waiting for KV memory or a batch slot.", static_cast<double>(g.queued));
  gauge(out, "dcp_sessions_active_peak", "gauge", "The most sessions active at once since the start.", static_cast<double>(g.peak_active));
  gauge(out, "dcp_kv_bytes", "gauge", "KV bytes held by the active sessions (KvCache::bytes; a flexformer session's recurrent states).", static_cast<double>(g.kv_bytes));
  gauge(out, "dcp_kv_capacity_bytes", "gauge", "KV cache storage allocated (KvCache::capacity_bytes).", static_cast<double>(g.kv_capacity_bytes));
  gauge(out, "dcp_kv_held_bytes", "gauge", "KV bytes admission counts: per session the larger of its reservation and its bytes.", static_cast<double>(g.kv_held_bytes));
  gauge(out, "dcp_kv_memory_bytes", "gauge", "The KV memory budget (serve.kv_memory_bytes).", static_cast<double>(g.kv_memory_bytes));
  gauge(out, "dcp_scheduler_steps_total", "counter", "Scheduler iterations that ran a forward.", static_cast<double>(g.steps));
  gauge(out, "dcp_scheduler_step_seconds_total", "counter", "Seconds those iterations took (forward, sampling, bookkeeping): the scheduler's busy time.", g.step_seconds);
  gauge(out, "dcp_prefill_tokens_total", "counter", "Prompt tokens run in prefill chunks by those iterations.", static_cast<double>(g.prefill_tokens));
  gauge(out, "dcp_decode_steps_total", "counter", "Scheduler iterations that ran only one-token decode steps (no prefill chunk).", static_cast<double>(g.decode_steps));
  gauge(out, "dcp_decode_step_tokens_total", "counter", "Tokens decoded by those iterations.", static_cast<double>(g.decode_step_tokens));
  gauge(out, "dcp_decode_step_seconds_total", "counter", "Seconds those iterations took (forward, sampling, bookkeeping).", g.decode_step_seconds);
  gauge(out, "dcp_prefill_chunks_shortened_total", "counter", "Prefill chunks run shorter than chunk_tokens / kv.chunk_pairs allow, to keep a step beside decoding sessions within max(serve.prefill_step_ratio decode steps, serve.prefill_step_ms).", static_cast<double>(g.prefill_chunks_shortened));
  gauge(out, "dcp_prefill_shortened_tokens_total", "counter", "Prompt tokens run in those shortened chunks.", static_cast<double>(g.prefill_shortened_tokens));
  gauge(out, "dcp_prefill_budget_decode_steps_total", "counter", "Decode-only steps the prefill budget ran while a prompt it governs waited, to measure a decode step.", static_cast<double>(g.prefill_budget_decode_steps));
  gauge(out, "dcp_sessions_cancelled_total", "counter", "Sessions cancelled (client gone or shutdown).", static_cast<double>(g.cancelled));
  gauge(out, "dcp_sessions_over_reservation_total", "counter", "Sessions whose cache grew past their reservation.", static_cast<double>(g.over_reservation));
  gauge(out, "dcp_saturated_seconds_total", "counter", "Seconds of scheduler iterations run while a request waited in the queue.", g.saturated_seconds);
  gauge(out, "dcp_saturated_session_seconds_total", "counter", "Active sessions integrated over those seconds (divided by them: the mean sessions held while requests waited).", g.saturated_session_seconds);
  gauge(out, "dcp_saturated_kv_byte_seconds_total", "counter", "KV bytes held (KvCache::bytes) integrated over those seconds.", g.saturated_kv_byte_seconds);
  histogram(out, "dcp_time_to_first_token_seconds", "From the request's arrival to its first generated token.", ttft_);
  histogram(out, "dcp_inter_token_latency_seconds", "Between two generated tokens of a session.", itl_);
  gauge(out, "process_resident_memory_bytes", "gauge", "Resident memory of the server process.", static_cast<double>(resident_bytes()));
  return out;
}

int64_t resident_bytes() {
  std::ifstream in("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(in >> size >> resident)) return 0;
  return resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

}  // namespace dcp::serve
