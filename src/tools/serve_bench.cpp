#include "tools/serve_bench.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <limits>
#include <mutex>
#include <random>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "dcp/data.h"
#include "dcp/infer.h"
#include "dcp/kv_policies.h"
#include "dcp/serve.h"
#include "infer/serve/api.h"
#include "infer/serve/client.h"
#include "infer/serve/scheduler.h"
#include "tools/bench_common.h"
#include "util/stats.h"
#include "util/thread_priority.h"

namespace dcp {
namespace {

// Puts the calling thread under SCHED_IDLE (Linux: it runs only when no other thread wants the core; no privilege
// needed to lower one's own policy). Returns "" or why the kernel refused.
double percentile(std::vector<double> v, double p) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  const auto k = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(v.size())));
  return v[std::min(v.size() - 1, k == 0 ? 0 : k - 1)];  // nearest rank
}

struct Spec {
  std::string policy;
  double budget = 1;
};

Spec parse_spec(const std::string& s) {
  const size_t at = s.find('@');
  Spec r{s.substr(0, at), 1};
  if (at != std::string::npos) {
    try {
      r.budget = std::stod(s.substr(at + 1));
    } catch (const std::exception&) {
      throw ConfigError(fmt::format("--policies: '{}' is not NAME or NAME@BUDGET", s));
    }
  }
  // What the server would refuse with a 400 is refused here, before any run (the server's own check).
  try {
    make_kv_policy_with_budget(r.policy, r.policy == "full" ? 1.0 : r.budget);
  } catch (const std::exception& e) {
    throw ConfigError(fmt::format("--policies: '{}': {}", s, e.what()));
  }
  return r;
}

// A latency or time for the report: '-' where the run had none (the row holds -1).
// A number for the report with `decimals` digits after `scale`, or '-' where the run had none (rows hold -1).
std::string or_dash(double value, int decimals, double scale = 1.0) {
  return value >= 0 ? fmt::format("{:.{}f}", scale * value, decimals) : std::string("-");
}
std::string ms_or_dash(double seconds) { return or_dash(seconds, 2, 1e3); }
std::string s_or_dash(double seconds) { return or_dash(seconds, 3); }

// Prompts of [min, max] bytes cut from the held-out documents at seeded offsets, ending on a UTF-8 boundary.
std::vector<std::string> make_prompts(const Config& cfg, const ServeBenchOptions& o, int64_t count) {
  DataConfig data = cfg.data;
  data.max_seq_len = 1 << 24;  // whole documents: prompts longer than the trained window
  const Corpus corpus = Corpus::load(data);
  std::vector<std::string_view> docs;
  for (int64_t id : corpus.heldout_ids()) {
    if (corpus.samples()[static_cast<size_t>(id)].length >= o.min_prompt) docs.push_back(corpus.bytes(id));
  }
  if (docs.empty()) {
    throw std::runtime_error(fmt::format("bench-serve: no held-out document of {} has {} bytes or more", data.path,
                                         o.min_prompt));
  }
  std::mt19937_64 rng(o.seed);
  std::vector<std::string> out;
  for (int64_t i = 0; i < count; ++i) {
    const std::string_view d = docs[rng() % docs.size()];
    const int64_t want = o.min_prompt + static_cast<int64_t>(rng() % static_cast<uint64_t>(o.max_prompt - o.min_prompt + 1));
    const int64_t len = std::min<int64_t>(want, static_cast<int64_t>(d.size()));
    const int64_t start = static_cast<int64_t>(rng() % static_cast<uint64_t>(d.size() - len + 1));
    std::string p(d.substr(static_cast<size_t>(start), static_cast<size_t>(len)));
    // Start and end on character boundaries (a cut inside a character is not a JSON string).
    size_t s = 0;
    while (s < p.size() && (static_cast<unsigned char>(p[s]) & 0xC0) == 0x80) ++s;
    p = p.substr(s);
    p.resize(serve::utf8_complete_prefix(p));
    out.push_back(p);
  }
  return out;
}

ServeBenchRow run_load(const Transformer& model, Config cfg, const std::string& id, const std::string& run,
                       const Spec& spec, int64_t clients, const std::vector<std::string>& prompts, int64_t max_tokens,
                       bool idle_clients) {
  cfg.serve.host = "127.0.0.1";
  cfg.serve.port = 0;
  cfg.serve.max_queue = std::max<int64_t>(cfg.serve.max_queue, static_cast<int64_t>(prompts.size()));
  cfg.serve.max_sessions = std::max<int64_t>(cfg.serve.max_sessions, clients);
  cfg.serve.http_threads = std::max<int64_t>(cfg.serve.http_threads, clients + 8);
  Server server(model, cfg, id);
  const int port = server.bind();
  std::thread serving([&] { server.run(); });
  ServeBenchRow row;
  row.run = run;
  row.policy = spec.policy;
  row.budget = spec.budget;
  row.clients = clients;
  row.requests = static_cast<int64_t>(prompts.size());
  row.kv_memory_bytes = cfg.serve.kv_memory_bytes;
  std::atomic<bool> running{true};
  std::atomic<int64_t> peak_sessions{0};
  std::atomic<double> peak_kv{0};
  std::thread monitor([&] {
    while (running) {
      const auto [status, text] = serve::get("127.0.0.1", port, "/metrics", 5);
      if (status == 200) {
        peak_sessions = std::max<int64_t>(peak_sessions, static_cast<int64_t>(serve::metric(text, "dcp_sessions_active")));
        peak_kv = std::max<double>(peak_kv, serve::metric(text, "dcp_kv_bytes"));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  struct Done {
    double sent = 0, first = -1;              // seconds after t0
    std::string failure;                      // why a request was not answered in full (status and message)
    std::vector<std::pair<double, double>> gaps;  // (start, end) of each inter-token gap, per byte
    int64_t bytes = 0, first_bytes = 0;       // all received, and those of the first event
    bool ok = false, abstained = false;
  };
  std::vector<Done> done(prompts.size());
  std::atomic<size_t> next{0};
  std::mutex priority_mu;
  std::string priority_error;  // a client thread whose SCHED_IDLE the kernel refused sends nothing
  std::vector<std::thread> workers;
  for (int64_t c = 0; c < clients; ++c) {
    workers.emplace_back([&] {
      if (idle_clients) {
        if (std::string why = lower_this_thread(ThreadPriority::idle); !why.empty()) {
          std::lock_guard<std::mutex> lock(priority_mu);
          priority_error = "SCHED_IDLE refused: " + why;
          return;
        }
      }
      for (size_t i = next++; i < prompts.size(); i = next++) {
        nlohmann::json body = {{"prompt", prompts[i]}, {"max_tokens", max_tokens}, {"temperature", 0},
                               {"stream", true}, {"kv_policy", spec.policy},
                               {"return_bytes", true}};
        if (spec.policy != "full") body["kv_budget"] = spec.budget;
        Done& d = done[i];
        d.sent = std::chrono::duration<double>(clock::now() - t0).count();
        const serve::ClientReply r = serve::complete("127.0.0.1", port, body, 600);
        d.ok = r.status == 200 && r.done && !r.last.is_null();
        if (!d.ok) {
          std::string why = r.status == 0 ? r.error : r.body.substr(0, 300);
          d.failure = fmt::format("HTTP {}: {}", r.status, why);
          spdlog::warn("bench-serve: {} {}@{}: request {} failed: {}", run, spec.policy, spec.budget, i, d.failure);
        }
        double prev = -1;
        for (size_t e = 0; e < r.events.size(); ++e) {
          const auto& ch = r.events[e].value("choices", nlohmann::json::array());
          if (ch.empty()) continue;
          // The generated bytes themselves (return_bytes): the text has U+FFFD, 3 bytes, for each invalid one.
          const size_t n = ch[0].value("bytes", nlohmann::json::array()).size();
          if (n == 0) continue;
          const double at = d.sent + r.event_s[e];
          if (d.first < 0) {
            d.first = at;  // bytes after the first in the first event: no gap (counted in d.bytes)
            d.first_bytes = static_cast<int64_t>(n);
          } else {
            const auto k = static_cast<double>(n);
            for (size_t b = 0; b < n; ++b) d.gaps.emplace_back(prev + (at - prev) * b / k, prev + (at - prev) * (b + 1) / k);
          }
          prev = at;
          d.bytes += static_cast<int64_t>(n);
        }
        if (d.ok) d.abstained = r.last.value("kv_cache", nlohmann::json::object()).value("abstained", false);
      }
    });
  }
  for (auto& w : workers) w.join();
  if (!priority_error.empty()) {
    running = false;
    monitor.join();
    server.shutdown();
    serving.join();
    throw std::runtime_error(fmt::format("bench-serve: --client-priority idle: {} (--client-priority normal runs the "
                                         "clients at the server's priority)", priority_error));
  }
  const double wall = std::chrono::duration<double>(clock::now() - t0).count();
  running = false;
  monitor.join();
  {
    const auto [status, text] = serve::get("127.0.0.1", port, "/metrics", 5);
    if (status == 200) {
      row.decode_steps = static_cast<int64_t>(serve::metric(text, "dcp_decode_steps_total"));
      row.decode_step_tokens = static_cast<int64_t>(serve::metric(text, "dcp_decode_step_tokens_total"));
      const double seconds = serve::metric(text, "dcp_decode_step_seconds_total");
      if (row.decode_steps > 0 && seconds > 0) row.decode_tokens_per_s = static_cast<double>(row.decode_step_tokens) / seconds;
      row.steps = static_cast<int64_t>(serve::metric(text, "dcp_scheduler_steps_total"));
      row.busy_s = serve::metric(text, "dcp_scheduler_step_seconds_total");
      row.prefill_tokens = static_cast<int64_t>(serve::metric(text, "dcp_prefill_tokens_total"));
      row.shortened_chunks = static_cast<int64_t>(serve::metric(text, "dcp_prefill_chunks_shortened_total"));
      row.shortened_tokens = static_cast<int64_t>(serve::metric(text, "dcp_prefill_shortened_tokens_total"));
      row.budget_decode_steps = static_cast<int64_t>(serve::metric(text, "dcp_prefill_budget_decode_steps_total"));
      row.saturated_s = serve::metric(text, "dcp_saturated_seconds_total");
      if (row.saturated_s > 0) {
        row.saturated_sessions = serve::metric(text, "dcp_saturated_session_seconds_total") / row.saturated_s;
        row.saturated_kv_bytes = serve::metric(text, "dcp_saturated_kv_byte_seconds_total") / row.saturated_s;
      }
    }
  }
  server.shutdown();
  serving.join();
  std::vector<double> ttft, itl, itl_prefill;
  for (size_t i = 0; i < done.size(); ++i) {
    const Done& d = done[i];
    row.answered += d.ok ? 1 : 0;
    row.failed += d.ok ? 0 : 1;
    if (!d.ok && row.first_failure.empty()) row.first_failure = d.failure;
    row.tokens += d.bytes;
    row.abstained += d.abstained ? 1 : 0;
    if (d.first >= 0) ttft.push_back(d.first - d.sent);
    for (const auto& [a, b] : d.gaps) {
      itl.push_back(b - a);
      // Did another request's prefill (between its send and its first token) overlap this gap?
      bool overlap = false;
      for (size_t j = 0; j < done.size() && !overlap; ++j) {
        overlap = j != i && done[j].first >= 0 && done[j].sent < b && done[j].first > a;
      }
      if (overlap) itl_prefill.push_back(b - a);
    }
  }
  row.wall_s = wall;
  row.tokens_per_s = static_cast<double>(row.tokens) / wall;
  if (run == "batching" || run == "batching-sequential") {
    // Arrival of each byte after a request's first: the end of its gap (an event of k bytes counts as k gaps).
    if (run == "batching") {
      double from = 0, to = std::numeric_limits<double>::infinity();
      for (const Done& d : done) {
        from = std::max(from, d.first);
        to = std::min(to, d.gaps.empty() ? d.first : d.gaps.back().second);
      }
      int64_t bytes = 0;
      for (const Done& d : done) {
        for (const auto& g : d.gaps) bytes += g.second > from && g.second <= to ? 1 : 0;
      }
      if (row.answered == row.requests && to > from) {
        row.window_s = to - from;
        row.window_bytes = bytes;
        row.window_tokens_per_s = static_cast<double>(bytes) / row.window_s;
      }
    } else {
      double seconds = 0;
      int64_t bytes = 0;
      for (const Done& d : done) {
        if (d.first < 0) continue;
        // As in the batching run: the bytes that arrived after the first event, over the time since it.
        seconds += (d.gaps.empty() ? d.first : d.gaps.back().second) - d.first;
        bytes += d.bytes - d.first_bytes;
      }
      if (row.answered == row.requests && seconds > 0) {
        row.window_s = seconds;
        row.window_bytes = bytes;
        row.window_tokens_per_s = static_cast<double>(bytes) / seconds;
      }
    }
  }
  row.ttft_p50 = percentile(ttft, 50);
  row.ttft_p99 = percentile(ttft, 99);
  row.itl_p50 = percentile(itl, 50);
  row.itl_p99 = percentile(itl, 99);
  row.itl_prefill_p50 = percentile(itl_prefill, 50);
  row.itl_prefill_p99 = percentile(itl_prefill, 99);
  row.peak_sessions = peak_sessions;
  row.peak_kv_bytes = peak_kv;
  spdlog::info("bench-serve: {} {}@{} clients {}: {}/{} answered, {:.1f} tokens/s, TTFT p50 {:.3f} s, ITL p50 {:.4f} "
               "p99 {:.4f} s, peak {} sessions", run, spec.policy, spec.budget, clients, row.answered, row.requests,
               row.tokens_per_s, row.ttft_p50, row.itl_p50, row.itl_p99, row.peak_sessions);
  return row;
}

std::string csv(const std::vector<ServeBenchRow>& rows) {
  std::string out = "run,policy,budget,clients,requests,answered,failed,tokens,wall_s,tokens_per_s,ttft_p50_s,ttft_p99_s,"
                    "itl_p50_s,itl_p99_s,itl_prefill_p50_s,itl_prefill_p99_s,peak_sessions,peak_kv_bytes,"
                    "kv_memory_bytes,abstained,decode_steps,decode_step_tokens,decode_tokens_per_s,saturated_s,saturated_sessions,"
                    "saturated_kv_bytes,window_s,window_tokens_per_s,repeat,window_bytes,steps,busy_s,prefill_tokens,"
                    "shortened_chunks,shortened_tokens,budget_decode_steps\n";
  for (const auto& r : rows) {
    out += fmt::format("{},{},{},{},{},{},{},{},{:.3f},{:.2f},{:.4f},{:.4f},{:.5f},{:.5f},{:.5f},{:.5f},{},{:.0f},{:.0f},{},{},{},{:.2f},{:.3f},{:.3f},{:.0f},{:.3f},{:.2f},{},{},{},{:.3f},{},{},{},{}\n",
                       r.run, r.policy, r.budget, r.clients, r.requests, r.answered, r.failed, r.tokens, r.wall_s,
                       r.tokens_per_s, r.ttft_p50, r.ttft_p99, r.itl_p50, r.itl_p99, r.itl_prefill_p50,
                       r.itl_prefill_p99, r.peak_sessions, r.peak_kv_bytes, r.kv_memory_bytes, r.abstained,
                       r.decode_steps, r.decode_step_tokens, r.decode_tokens_per_s, r.saturated_s,
                       r.saturated_sessions, r.saturated_kv_bytes, r.window_s, r.window_tokens_per_s, r.repeat,
                       r.window_bytes, r.steps, r.busy_s, r.prefill_tokens, r.shortened_chunks, r.shortened_tokens,
                       r.budget_decode_steps);
  }
  return out;
}

}  // namespace

double BatchingPool::ratio() const {
  const double b = batched_tokens_per_s(), q = sequential_tokens_per_s();
  return usable > 0 && q > 0 ? b / q : 0;
}

BatchingPool pool_batching(const std::vector<const ServeBenchRow*>& batched,
                           const std::vector<const ServeBenchRow*>& sequential) {
  if (batched.size() != sequential.size()) {
    throw std::invalid_argument(fmt::format("pool_batching: {} batched runs against {} sequential ones (pairs needed)",
                                            batched.size(), sequential.size()));
  }
  const auto usable = [](const ServeBenchRow& r) {
    return r.window_s > 0 && r.window_bytes > 0 && r.answered == r.requests && r.failed == 0;
  };
  BatchingPool pool;
  pool.pairs = static_cast<int64_t>(batched.size());
  std::vector<double> counted;
  for (size_t p = 0; p < batched.size(); ++p) {
    const ServeBenchRow& b = *batched[p];
    const ServeBenchRow& q = *sequential[p];
    if (!usable(b) || !usable(q)) {
      pool.ratios.push_back(std::numeric_limits<double>::quiet_NaN());
      continue;
    }
    ++pool.usable;
    pool.batched_bytes += b.window_bytes;
    pool.batched_s += b.window_s;
    pool.sequential_bytes += q.window_bytes;
    pool.sequential_s += q.window_s;
    pool.ratios.push_back((static_cast<double>(b.window_bytes) / b.window_s) /
                          (static_cast<double>(q.window_bytes) / q.window_s));
    counted.push_back(pool.ratios.back());
  }
  pool.median_ratio = median(counted);
  return pool;
}

std::vector<ServeBenchRow> run_serve_bench(Transformer model, const Config& cfg_in, const std::string& checkpoint,
                                           const ServeBenchOptions& o) {
  Config cfg = cfg_in;
  const int64_t longest = std::max(o.max_tokens, o.batching_sessions > 0 ? o.batching_tokens : int64_t{0});
  cfg.serve.max_context = std::max<int64_t>(cfg.serve.max_context, o.max_prompt + longest + 1);
  cfg.serve.max_tokens = std::max<int64_t>(cfg.serve.max_tokens, longest);
  cfg.serve.max_prompt_bytes = std::max<int64_t>(cfg.serve.max_prompt_bytes, o.max_prompt);
  const std::string id = std::filesystem::path(checkpoint).lexically_normal().parent_path().filename().string();
  std::vector<Spec> specs;
  for (const auto& s : o.policies) specs.push_back(parse_spec(s));
  const bool recurrent = decodes_recurrently(model);
  if (recurrent && o.memory_requests > 0) {
    for (const auto& s : specs) {
      if (s.policy != "full") {
        throw ConfigError(fmt::format("--policies: {}: {} is a flexformer checkpoint (recurrent states, no KV cache "
                                      "to compress); use --policies full", s.policy, checkpoint));
      }
    }
  }
  if (o.client_priority != "idle" && o.client_priority != "normal") {
    throw ConfigError(fmt::format("--client-priority: '{}' is neither idle nor normal", o.client_priority));
  }
  const bool idle = o.client_priority == "idle";
  const double load_start = load_average_1min();
  const auto started = std::chrono::steady_clock::now();
  std::vector<ServeBenchRow> rows;
  int64_t most = std::max(o.memory_requests, o.batching_sessions);
  for (int64_t c : o.clients) most = std::max(most, std::max(o.requests, c));
  const std::vector<std::string> prompts = make_prompts(cfg, o, most);
  // Throughput and latency, full cache, memory not binding.
  Config wide = cfg;
  wide.serve.kv_memory_bytes = 1e12;
  for (int64_t c : o.clients) {
    const int64_t n = std::max(o.requests, c);
    rows.push_back(run_load(model, wide, id, c == 1 ? "sequential" : "throughput", {"full", 1}, c,
                            std::vector<std::string>(prompts.begin(), prompts.begin() + n), o.max_tokens, idle));
  }
  // Batched decoding at N concurrent sessions: N requests at once, then the same N one after another.
  // Pairs alternate which run goes first (batched, sequential; sequential, batched; ...).
  if (o.batching_sessions > 0) {
    const std::vector<std::string> batch(prompts.begin(), prompts.begin() + o.batching_sessions);
    for (int64_t rep = 1; rep <= o.batching_repeats; ++rep) {
      for (int k = 0; k < 2; ++k) {
        const bool batched = (k == 0) == (rep % 2 == 1);
        rows.push_back(run_load(model, wide, id, batched ? "batching" : "batching-sequential", {"full", 1},
                                batched ? o.batching_sessions : 1, batch, o.batching_tokens, idle));
        rows.back().repeat = rep;
      }
    }
  }
  // Sessions held at one KV memory budget, per policy.
  const KvCacheSpec spec = kv_cache_spec(model);
  KvCache probe(spec);
  const double mean_tokens = (o.min_prompt + o.max_prompt) / 2.0 + o.max_tokens + 1;
  const double memory = o.memory_bytes > 0 ? o.memory_bytes
                                           : o.memory_full_sessions * mean_tokens * spec.layers * spec.kv_heads *
                                                 static_cast<double>(probe.entry_bytes());
  Config fixed = cfg;
  fixed.serve.kv_memory_bytes = memory;
  if (o.memory_requests > 0) {
    for (const Spec& s : specs) {
      rows.push_back(run_load(model, fixed, id, "memory", s, o.memory_clients,
                              std::vector<std::string>(prompts.begin(), prompts.begin() + o.memory_requests), o.max_tokens,
                              idle));
    }
  }
  const double load_end = load_average_1min();
  const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();

  // The report.
  const ServeBenchRow* seq = nullptr;
  const ServeBenchRow* b16 = nullptr;
  const ServeBenchRow* mem_full = nullptr;
  std::vector<const ServeBenchRow*> batching, batching_seq;  // by pair
  for (const auto& r : rows) {
    if (r.run == "batching") batching.push_back(&r);
    if (r.run == "batching-sequential") batching_seq.push_back(&r);
    if (r.run == "sequential") seq = &r;
    if (r.run == "throughput" && r.clients == 16) b16 = &r;
    if (r.run == "memory" && r.policy == "full") mem_full = &r;
  }
  std::ostringstream md;
  md << "# dcp bench-serve: continuous batching and KV memory on loopback\n\n";
  md << fmt::format("```sh\n{}\n```\n\n", own_command_line());
  md << fmt::format("Checkpoint `{}` (d_model {}, {} layers, {} heads, {}), threads {} (serve.threads; 0 = every core), HTTP threads' priority {} (serve.http_priority), scheduler {}, prefill chunk "
                    "{} tokens{} ({} per step; {}). {} UTC, {:.0f} s in all; 1-minute load average {:.2f} at the start, "
                    "{:.2f} at the end. BLAS: {}.\n\n",
                    checkpoint, cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads,
                    c10::toString(kv_cache_spec(model).dtype), cfg.serve.threads, cfg.serve.http_priority,
                    cfg.serve.scheduler, cfg.serve.chunk_tokens > 0 ? cfg.serve.chunk_tokens : cfg.kv.chunk_tokens,
                    cfg.kv.chunk_pairs > 0
                        ? fmt::format(" and at most {} query-key pairs (kv.chunk_pairs)", cfg.kv.chunk_pairs)
                        : std::string(),
                    cfg.serve.prefill_chunks,
                    serve::PrefillBudget::enabled(cfg.serve.prefill_step_ratio, cfg.serve.prefill_step_ms / 1000.0)
                        ? fmt::format("beside decoding sessions shortened so that a step takes about max({} decode "
                                      "steps, {} ms), serve.prefill_step_ratio and serve.prefill_step_ms",
                                      cfg.serve.prefill_step_ratio, cfg.serve.prefill_step_ms)
                        : std::string("serve.prefill_step_ratio and serve.prefill_step_ms 0: never shortened"),
                    utc_now("%Y-%m-%d %H:%M"), total_s, load_start, load_end,
                    blas_description());
  md << (idle ? "The clients (threads of this process) run under SCHED_IDLE (`--client-priority idle`): on time the "
                "server's threads leave, as a load generator on another machine would; their arrival times are late "
                "by as long as the server keeps every core busy.\n\n"
              : "The clients (threads of this process) run at the server's priority (`--client-priority normal`): "
                "their reading of the streams competes with the server for the same cores.\n\n");
  if (recurrent) {
    md << fmt::format("A flexformer checkpoint (attention.feature_map {}, {} features): each session decodes from its "
                      "recurrent states, the same bytes for every prompt (the rows' KV bytes are those states), so "
                      "policy full is the only one{}.\n\n",
                      cfg.attention.feature_map, cfg.attention.num_features,
                      o.memory_requests > 0
                          ? fmt::format("; the memory runs' budget is what {} full softmax caches of the mean prompt of "
                                        "this model shape would need", o.memory_full_sessions)
                          : std::string());
  }
  md << fmt::format("Prompts: {} to {} bytes cut from the held-out documents of `{}` (seed {}); every request streams "
                    "{} greedy bytes. The trained window is {} tokens: longer prompts make the model extrapolate its "
                    "positions, which changes what it writes, not what a step costs. Latencies are the clients' "
                    "(arrival of each server-sent event; an event of k bytes counts as k equal gaps).\n\n",
                    o.min_prompt, o.max_prompt, cfg.data.path, o.seed, o.max_tokens, cfg.data.max_seq_len);
  if (!batching.empty() && batching.size() == batching_seq.size()) {
    const int64_t n = o.batching_sessions;
    const BatchingPool pool = pool_batching(batching, batching_seq);
    std::string pairs;
    for (size_t p = 0; p < batching.size(); ++p) {
      const ServeBenchRow& b = *batching[p];
      const ServeBenchRow& q = *batching_seq[p];
      const double r = pool.ratios[p];
      pairs += fmt::format("| {} | {} | {} | {} | {} | {} / {} |\n", b.repeat,
                           batching[p] < batching_seq[p] ? "batched" : "one after another",  // rows in run order
                           or_dash(b.window_tokens_per_s, 1), or_dash(q.window_tokens_per_s, 1),
                           std::isnan(r) ? std::string("- (no decoding interval or a failed request)")
                                         : fmt::format("{:.2f}x", r),
                           or_dash(b.window_s, 3), or_dash(q.window_s, 3));
    }
    std::string pooled =
        "- (no pair had a decoding interval in both runs without a failed request; longer completions "
        "(--batching-tokens) give one)";
    if (pool.usable > 0) {
      double lo = std::numeric_limits<double>::infinity(), hi = -lo;
      for (double r : pool.ratios) {
        if (std::isnan(r)) continue;
        lo = std::min(lo, r);
        hi = std::max(hi, r);
      }
      pooled = fmt::format("**{:.2f}x** ({:.1f} tokens/s against {:.1f}; the {} pair ratio{} {})", pool.ratio(),
                           pool.batched_tokens_per_s(), pool.sequential_tokens_per_s(), pool.usable,
                           pool.usable == 1 ? "" : "s",
                           pool.usable == 1 ? fmt::format("{:.2f}x", lo)
                                            : fmt::format("range {:.2f}x..{:.2f}x, median {:.2f}x", lo, hi,
                                                          pool.median_ratio));
    }
    md << fmt::format("**Batching at {} concurrent session{}** ({} client{} send one request each at once, completions "
                      "of {} bytes, prompts the first {} of those above; the decode rate is the bytes the clients "
                      "received while every session was decoding, from the last first byte to the first last byte; "
                      "against the same {} request{} one after another: the bytes after each first event over the "
                      "seconds from it to the last byte; {} pair{} of runs, alternating which runs first, pooled "
                      "as every pair's bytes over every pair's seconds): {} (the target, >= 3x, is stated at 16 "
                      "sessions).\n\n",
                      n, n == 1 ? "" : "s", n, n == 1 ? "" : "s", o.batching_tokens, n, n, n == 1 ? "" : "s",
                      batching.size(), batching.size() == 1 ? "" : "s", pooled);
    md << "| pair | first | batched tokens/s | one after another tokens/s | ratio | seconds (batched / one after another) |\n"
          "|---|---|---|---|---|---|\n"
       << pairs << "\n";
  }
  if (seq && b16) {
    md << fmt::format("**Batching under the mixed load** (the 16-client throughput run against the sequential one, "
                      "server side): {:.1f} tokens/s against {:.1f}, {:.2f}x, over the scheduler iterations that ran "
                      "no prefill chunk ({} iterations of {:.1f} decoding sessions on average, against {} of 1). End to end, prompts' "
                      "prefill included (completion bytes over the run's wall time): {:.1f} against {:.1f} tokens/s, "
                      "{:.2f}x; prefill is the same work either way, so this ratio is bounded by its share.\n\n",
                      b16->decode_tokens_per_s, seq->decode_tokens_per_s,
                      b16->decode_tokens_per_s / seq->decode_tokens_per_s, b16->decode_steps,
                      b16->decode_steps > 0 ? static_cast<double>(b16->decode_step_tokens) / b16->decode_steps : 0.0,
                      seq->decode_steps, b16->tokens_per_s, seq->tokens_per_s, b16->tokens_per_s / seq->tokens_per_s);
  }
  bool latency_said = false;
  for (const auto& r : rows) {
    if (r.run != "throughput" || r.itl_prefill_p50 <= 0) continue;
    if (!latency_said) md << "**Latency during prefills** (target: p99 < 2 x p50 of the inter-token gaps that overlapped another request's prefill):";
    md << fmt::format("{} {} clients: p50 {:.1f} ms, p99 {:.1f} ms, p99 / p50 = **{:.2f}** (over all gaps p50 {:.1f} ms, "
                      "p99 {:.1f} ms)", latency_said ? ";" : "", r.clients, 1e3 * r.itl_prefill_p50, 1e3 * r.itl_prefill_p99,
                      r.itl_prefill_p99 / r.itl_prefill_p50, 1e3 * r.itl_p50, 1e3 * r.itl_p99);
    latency_said = true;
  }
  if (latency_said) md << ".\n\n";
  if (mem_full) {
    // Two measures of the sessions one budget holds: the peak (an extreme of the random mix of prompt lengths that
    // happen to be in flight together) and the mean while requests waited for admission (the budget was full).
    auto ratio = [](double a, double b) { return b > 0 && a >= 0 ? fmt::format("{:.2f}x", a / b) : std::string("-"); };
    auto mean = [](double m) { return m >= 0 ? fmt::format("{:.2f}", m) : std::string("- (no request waited)"); };
    md << fmt::format("**Memory**: at serve.kv_memory_bytes = {:.0f} ({} clients, {} requests) {} held at "
                      "most {} session(s) at once, {} on average while requests waited for admission ({:.0f} s);",
                      memory, o.memory_clients, o.memory_requests,
                      recurrent ? "flexformer's recurrent states" : "the full cache", mem_full->peak_sessions,
                      mean(mem_full->saturated_sessions), mem_full->saturated_s);
    for (const auto& r : rows) {
      if (r.run != "memory" || r.policy == "full") continue;
      md << fmt::format(" {} at {} held at most {} ({}), {} on average while requests waited ({}, {:.0f} s)",
                        r.policy, r.budget, r.peak_sessions,
                        ratio(static_cast<double>(r.peak_sessions), static_cast<double>(mem_full->peak_sessions)),
                        mean(r.saturated_sessions), ratio(r.saturated_sessions, mem_full->saturated_sessions), r.saturated_s);
      md << (&r == &rows.back() ? "." : ";");
    }
    md << (recurrent ? "\n\n" : " (target: minimax at 0.25 >= 3x the full cache's sessions).\n\n");
  }
  md << "| run | policy | budget | clients | requests | answered | tokens/s | decode tokens/s | TTFT p50 s | TTFT p99 s | "
        "ITL p50 ms | ITL p99 ms | ITL p99 ms in prefills | peak sessions | peak KV MB | sessions while saturated | KV MB "
        "while saturated | abstained |\n";
  md << "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& r : rows) {
    md << fmt::format("| {} | {} | {} | {} | {} | {} | {:.1f} | {} | {} | {} | {} | {} | {} | {} | {:.1f} | {} | {} | {} |\n",
                      r.repeat > 0 ? fmt::format("{} (pair {})", r.run, r.repeat) : r.run, r.policy, r.budget,
                      r.clients, r.requests, r.answered, r.tokens_per_s, or_dash(r.decode_tokens_per_s, 1),
                      s_or_dash(r.ttft_p50), s_or_dash(r.ttft_p99), ms_or_dash(r.itl_p50), ms_or_dash(r.itl_p99),
                      ms_or_dash(r.itl_prefill_p99), r.peak_sessions,
                      r.peak_kv_bytes / 1e6,
                      or_dash(r.saturated_sessions, 2),
                      or_dash(r.saturated_kv_bytes, 1, 1e-6), r.abstained);
  }
  // Where each run's time went on the server's side (its /metrics at the end of the run).
  md << "\nThe server's scheduler in each run (/metrics at its end; docs/serve.md \"Metrics\"): busy = the seconds of "
        "its steps over the run's wall time; decode-only steps = steps that ran no prefill chunk, with the sessions "
        "each decoded on average; prefill tokens per chunk step = the prompt tokens prefilled over the steps that ran "
        "a chunk; shortened = the chunks the prefill budget cut (and their mean tokens); measuring = the decode-only "
        "steps the budget ran to measure a decode step.\n\n"
        "| run | policy | budget | clients | steps | busy s / wall s | decode-only steps | sessions per decode-only step | "
        "prefill tokens per chunk step | shortened chunks (tokens each) | measuring steps |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& r : rows) {
    const int64_t chunk_steps = r.steps - r.decode_steps;
    md << fmt::format("| {} | {} | {} | {} | {} | {:.1f} / {:.1f} ({:.0f}%) | {} | {} | {} | {} | {} |\n",
                      r.repeat > 0 ? fmt::format("{} (pair {})", r.run, r.repeat) : r.run, r.policy, r.budget,
                      r.clients, r.steps, r.busy_s, r.wall_s, r.wall_s > 0 ? 100.0 * r.busy_s / r.wall_s : 0.0,
                      r.decode_steps,
                      r.decode_steps > 0 ? fmt::format("{:.1f}", static_cast<double>(r.decode_step_tokens) / r.decode_steps)
                                         : std::string("-"),
                      chunk_steps > 0 ? fmt::format("{:.0f}", static_cast<double>(r.prefill_tokens) / chunk_steps)
                                      : std::string("-"),
                      r.shortened_chunks > 0
                          ? fmt::format("{} ({:.0f})", r.shortened_chunks,
                                        static_cast<double>(r.shortened_tokens) / r.shortened_chunks)
                          : std::string("0"),
                      r.budget_decode_steps);
  }
  for (const auto& r : rows) {
    if (r.failed == 0) continue;
    md << fmt::format("\n**{} of {} requests of the {} run of {}@{} failed** (counted in no latency); the first: {}\n",
                      r.failed, r.requests, r.run, r.policy, r.budget, r.first_failure);
  }
  if (o.memory_requests == 0) md << "\nNo memory runs (`--memory-requests 0`).\n";
  if (o.batching_sessions == 0) md << "\nNo batching runs (`--batching-sessions 0`).\n";
  if (!o.out.empty()) {
    std::filesystem::create_directories(std::filesystem::path(o.out).parent_path().empty()
                                            ? std::filesystem::path(".")
                                            : std::filesystem::path(o.out).parent_path());
    const std::string csv_path = o.out + ".csv", png = o.out + ".png";
    write_text(csv_path, csv(rows));
    if (o.plot && gnuplot_available()) {
      const bool memory_runs = mem_full != nullptr;
      std::string script = fmt::format(
          "set terminal pngcairo noenhanced size {},450 font ',10'\nset output '{}'\nset datafile separator ','\n"
          "set multiplot layout 1,{}\nset title 'throughput, full cache'\nset xlabel 'concurrent clients'\n"
          "set ylabel 'tokens/s'\nset logscale x 2\nset grid\n"
          "plot '{}' using ($4):(stringcolumn(1) eq 'throughput' || stringcolumn(1) eq 'sequential' ? $10 : 1/0) with linespoints lw 2 title 'tokens/s'\n",
          memory_runs ? 1100 : 600, png, memory_runs ? 2 : 1, csv_path);
      if (memory_runs) {
        script += fmt::format(
            "unset logscale x\nset title 'sessions held at {:.0f} KV bytes'\nset xlabel ''\nset ylabel 'sessions'\n"
            "set style data histograms\nset yrange [0:*]\nset style fill solid 0.6\nset boxwidth 0.8\n"
            "set xtics rotate by -30\nset key below\n"
            "plot '< grep ^memory {}' using 17:xtic(sprintf('%s@%s', stringcolumn(2), stringcolumn(3))) title 'peak', "
            "'' using 25 title 'mean while requests waited'\n",
            memory, csv_path);
      }
      script += "unset multiplot\n";
      run_gnuplot(script, o.out + ".gnuplot", o.out + ".gnuplot.log");
      md << fmt::format("\n![throughput and sessions]({})\n", std::filesystem::path(png).filename().string());
    }
    write_text(o.out + ".md", md.str());
    fmt::print("bench-serve: wrote {}.md, {}{}\n", o.out, csv_path,
               std::filesystem::exists(png) && o.plot ? ", " + png : std::string(" (no plot)"));
  }
  fmt::print("{}", md.str());
  return rows;
}

}  // namespace dcp
