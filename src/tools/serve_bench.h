// `dcp bench-serve`: a bounded load on dcp serve over loopback (docs/serve.md "Benchmark"): N concurrent
// streaming clients send prompts cut from held-out documents, and each run reports throughput, time to first
// token and inter-token latency percentiles as the clients saw them, and the sessions the server held at once.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dcp/config.h"
#include "dcp/model.h"

namespace dcp {

struct ServeBenchOptions {
  std::vector<int64_t> clients{1, 4, 16, 64};  ///< concurrency levels of the throughput runs (policy full)
  int64_t requests = 16;       ///< requests per run: max(requests, clients)
  int64_t min_prompt = 1024, max_prompt = 8192;  ///< prompt bytes, uniform, cut from held-out documents
  int64_t max_tokens = 128;    ///< completion bytes per request (greedy, so every request runs to max_tokens)
  /// The batching runs (the target "batched decoding at 16 concurrent sessions"): `batching_sessions` clients send
  /// one request each at once, `batching_tokens` completion bytes each, so that all of them decode together once
  /// every prompt is prefilled; then the same requests one after another (one client). 0 = no batching runs.
  int64_t batching_sessions = 16;
  int64_t batching_tokens = 1024;
  /// Pairs of batching runs (batched and one after another), alternating which of the two runs first (ABBA: with
  /// an even number of pairs a linear drift of the machine's speed weighs on both alike); the target is read on
  /// the pooled rates (every pair's bytes over every pair's seconds), each pair's ratio reported beside it.
  int64_t batching_repeats = 4;
  /// The memory runs: policy specs "NAME" or "NAME@BUDGET", each with `memory_clients` clients at
  /// serve.kv_memory_bytes = memory_bytes (0: what `memory_full_sessions` full caches of the mean prompt need).
  std::vector<std::string> policies{"full", "window@0.25", "window@0.5", "minimax@0.25", "minimax@0.5"};
  int64_t memory_clients = 32;
  int64_t memory_requests = 32;  ///< 0 = no memory runs (throughput and latency only)
  double memory_bytes = 0;
  int64_t memory_full_sessions = 4;
  uint64_t seed = 1;
  /// The clients' (load generator's) CPU priority: "idle" runs each client thread under Linux SCHED_IDLE, so that
  /// where it shares the server's cores it takes only time they leave idle, as a load generator on another machine
  /// would (the server's scheduler and handler threads keep theirs; a client's arrival times are then late by as
  /// long as the server keeps both cores busy, a few milliseconds against windows of seconds); "normal" leaves the
  /// clients at the server's priority (the clients' reading and parsing then competes with the decode step).
  std::string client_priority = "normal";
  std::string out;             ///< files out.md, out.csv, out.png (+ .gnuplot)
  bool plot = true;
};

/// One run's numbers.
struct ServeBenchRow {
  std::string run;       ///< throughput | sequential | memory | batching | batching-sequential
  int64_t repeat = 0;    ///< the pair (1, 2, ..) of a batching run; 0 for the other runs
  std::string policy;
  double budget = 1;
  int64_t clients = 0, requests = 0, answered = 0, failed = 0;
  std::string first_failure;  ///< the first failed request's HTTP status and message ("" when none failed)
  int64_t tokens = 0;    ///< completion bytes received
  double wall_s = 0, tokens_per_s = 0;
  double ttft_p50 = 0, ttft_p99 = 0, itl_p50 = 0, itl_p99 = 0;  ///< seconds
  /// Inter-token latency p50 / p99 of the gaps that overlapped a prefill of another session (a long prompt
  /// being prefilled while this stream decodes), -1 when none did.
  double itl_prefill_p50 = -1, itl_prefill_p99 = -1;
  int64_t peak_sessions = 0;     ///< most sessions active at once (sampled from /metrics every 20 ms)
  double peak_kv_bytes = 0;      ///< most KV bytes held at once (KvCache::bytes, sampled likewise)
  double kv_memory_bytes = 0;
  /// While requests waited in the queue (dcp_saturated_* of /metrics at the end of the run): those seconds, and the
  /// mean sessions and KV bytes the server held over them (-1 when no request ever waited).
  double saturated_s = 0, saturated_sessions = -1, saturated_kv_bytes = -1;
  int64_t abstained = 0;         ///< requests whose minimax policy kept some head exact
  /// The server's scheduler iterations that ran no prefill chunk (dcp_decode_step_* of /metrics at the end of the
  /// run): their number, the tokens they decoded, and those tokens per second of those iterations (decode
  /// throughput without prefill; -1 when no such iteration ran).
  int64_t decode_steps = 0, decode_step_tokens = 0;
  double decode_tokens_per_s = -1;
  /// The batching runs' decode rate as the clients saw it (-1 in other runs). Run "batching" (every request sent
  /// at once): the seconds during which every session was decoding (from the last first byte to the first last
  /// byte) and the bytes the clients received in them per second. Run "batching-sequential" (one client): the
  /// seconds from each request's first byte to its last, summed, and the bytes that arrived after each request's
  /// first event per second.
  double window_s = -1, window_tokens_per_s = -1;
  int64_t window_bytes = -1;  ///< the bytes counted in window_s (-1 in other runs); window_tokens_per_s is their rate
  /// The server's scheduler over the run (/metrics at its end): iterations that ran a forward and their seconds
  /// (dcp_scheduler_steps_total, dcp_scheduler_step_seconds_total: busy_s / wall_s is how much of the run the
  /// scheduler computed), prompt tokens prefilled (dcp_prefill_tokens_total), prefill chunks the prefill budget
  /// shortened and their tokens, and the decode-only steps the budget ran to measure a decode step.
  int64_t steps = 0, prefill_tokens = 0, shortened_chunks = 0, shortened_tokens = 0, budget_decode_steps = 0;
  double busy_s = 0;
};

/// The batching pairs pooled (the target's figure): every usable pair's window bytes over its window seconds, each
/// side. A pair is usable when both of its runs have a decoding interval (window_s > 0) holding bytes
/// (window_bytes > 0) and answered every request without a failure.
struct BatchingPool {
  int64_t pairs = 0, usable = 0;      ///< pairs given; pairs that counted
  int64_t batched_bytes = 0, sequential_bytes = 0;
  double batched_s = 0, sequential_s = 0;
  std::vector<double> ratios;         ///< each pair's ratio (batched rate / sequential rate); NaN for a pair not usable
  double median_ratio = 0;            ///< median of the usable pairs' ratios (0 when none)
  /// batched rate over sequential rate, pooled; 0 when no pair was usable.
  double ratio() const;
  double batched_tokens_per_s() const { return batched_s > 0 ? static_cast<double>(batched_bytes) / batched_s : 0; }
  double sequential_tokens_per_s() const {
    return sequential_s > 0 ? static_cast<double>(sequential_bytes) / sequential_s : 0;
  }
};
/// Pools the pairs `batched[i]`, `sequential[i]` (rows of runs "batching" and "batching-sequential"). Throws
/// std::invalid_argument when the two lists differ in length.
BatchingPool pool_batching(const std::vector<const ServeBenchRow*>& batched,
                           const std::vector<const ServeBenchRow*>& sequential);

/// Runs the benchmark on `model` (cfg: the checkpoint's config with serve.* resolved) and writes the report;
/// returns the rows. Throws std::runtime_error when the held-out documents hold no prompt of min_prompt bytes or
/// a server cannot start, ConfigError for a bad policy spec.
std::vector<ServeBenchRow> run_serve_bench(Transformer model, const Config& cfg, const std::string& checkpoint,
                                           const ServeBenchOptions& options);

}  // namespace dcp
