#include <httplib.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <chrono>
#include <ctime>
#include <mutex>
#include <random>
#include <thread>

#include "dcp/kv_policies.h"
#include "dcp/serve.h"
#include "infer/serve/api.h"
#include "infer/serve/metrics.h"
#include "infer/serve/page.h"
#include "infer/serve/scheduler.h"
#include "util/thread_priority.h"

namespace dcp {
namespace {

// httplib's pool of connection threads, each lowered before its first connection (serve.http_priority): "low" sets
// the thread's nice value to 19 (CFS weight 15 against 1024 at nice 0), "idle" puts it under Linux SCHED_IDLE. A
// handler then runs mostly on time the scheduler's threads leave, and its wake-ups (one per streamed token) rarely
// or never preempt them. On 2 cores the scheduler kept busy, the handlers of 16 streams woken every step took ~20%
// of the decode step's rate at normal priority (bench/results/cpu2_202612_serve_http_priority.md). An unprivileged
// thread cannot raise its priority again, so the pool's threads stay lowered for every request they serve.
class LoweredThreadPool : public httplib::TaskQueue {
 public:
  LoweredThreadPool(size_t threads, ThreadPriority priority) : pool_(threads), priority_(priority) {}
  void enqueue(std::function<void()> fn) override {
    pool_.enqueue([fn = std::move(fn), priority = priority_] {
      thread_local bool lowered = false;
      if (!lowered) {
        lowered = true;
        if (const std::string why = lower_this_thread(priority); !why.empty()) {
          static std::once_flag warned;
          std::call_once(warned, [&why, priority] {
            spdlog::warn("serve: serve.http_priority {}: refused ({}); connections run at the server's priority",
                         thread_priority_name(priority), why);
          });
        }
      }
      fn();
    });
  }
  void shutdown() override { pool_.shutdown(); }

 private:
  httplib::ThreadPool pool_;
  ThreadPriority priority_;
};

using serve::ApiError;
using serve::Job;

// httplib's server with one more operation: closing the listening socket while the connections it accepted go on
// (httplib's own stop() also ends every stream at its next chunk). On Linux shutdown() of a listening socket makes
// the blocked accept() fail; listen_internal then closes the socket and waits for its workers to finish.
class HttpServer : public httplib::Server {
 public:
  void close_listener() {
    const auto sock = svr_sock_.load();
    if (sock != INVALID_SOCKET) ::shutdown(sock, SHUT_RDWR);
  }
  // Debian's compiled httplib listens with a backlog of 5 (CPPHTTPLIB_LISTEN_BACKLOG): a burst of clients overflows
  // it and the kernel drops their connections. listen() again on the bound socket sets a longer one.
  bool set_backlog(int n) {
    const auto sock = svr_sock_.load();
    return sock != INVALID_SOCKET && ::listen(sock, n) == 0;
  }
};

std::string dump(const nlohmann::json& j) { return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }

}  // namespace

struct Server::Impl {
  Config cfg;
  std::string model_id;
  serve::RequestLimits limits;
  serve::Metrics metrics;
  std::unique_ptr<serve::Scheduler> scheduler;
  HttpServer http;
  int port = -1;
  std::atomic<bool> draining{false};
  std::atomic<bool> listener_closed{false};
  std::atomic<int64_t> in_flight{0};  // completion handlers and streams not yet done
  std::atomic<uint64_t> next_id{1};
  std::mutex shutdown_mu;
  std::thread shutdown_thread;
  std::string page;

  void routes();
  void completions(const httplib::Request& req, httplib::Response& res);
  void reply_error(httplib::Response& res, const ApiError& e) {
    res.status = e.status;
    if (e.status == 503) res.set_header("Retry-After", std::to_string(cfg.serve.retry_after_s));
    res.set_content(dump(e.json()), "application/json");
    metrics.request(e.status);
  }
  nlohmann::json kv_json(const Job& job) const;
  nlohmann::json chunk_json(const Job& job, const std::string& text, const std::string& raw, const nlohmann::json& finish) const;
  void graceful();
};

Server::Server(Transformer model, const Config& cfg, std::string model_id) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.cfg = cfg;
  m.model_id = std::move(model_id);
  const ServeConfig& s = cfg.serve;
  m.limits.max_tokens = s.max_tokens;
  m.limits.default_max_tokens = std::min(s.default_max_tokens, s.max_tokens);
  m.limits.max_prompt_bytes = s.max_prompt_bytes;
  m.limits.max_context = s.max_context > 0 ? s.max_context : cfg.data.max_seq_len;
  m.limits.default_policy = s.kv_policy.empty() ? cfg.kv.policy : s.kv_policy;
  m.limits.default_budget = s.kv_budget > 0 ? s.kv_budget : cfg.kv.budget;
  if (m.limits.default_policy == "full") m.limits.default_budget = 1;
  m.limits.model_id = m.model_id;
  try {
    make_kv_policy_with_budget(m.limits.default_policy, m.limits.default_budget);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(fmt::format("serve.kv_policy {} / serve.kv_budget {}: {}", m.limits.default_policy,
                                  m.limits.default_budget, e.what()));
  }
  serve::SchedulerOptions o;
  o.kv_memory_bytes = static_cast<int64_t>(s.kv_memory_bytes);
  o.max_sessions = s.max_sessions;
  o.max_queue = s.max_queue;
  o.chunk_tokens = s.chunk_tokens > 0 ? s.chunk_tokens : cfg.kv.chunk_tokens;
  o.chunk_pairs = cfg.kv.chunk_pairs;
  o.prefill_chunks = s.prefill_chunks;
  o.prefill_step_ratio = s.prefill_step_ratio;
  o.prefill_step_ms = s.prefill_step_ms;
  o.batched = s.scheduler == "batched";
  o.threads = s.threads;
  o.retry_after_s = s.retry_after_s;
  m.scheduler = std::make_unique<serve::Scheduler>(std::move(model), o, m.metrics);
  m.limits.recurrent = m.scheduler->recurrent();
  if (m.limits.recurrent && m.limits.default_policy != "full") {
    throw ConfigError(fmt::format("{} {}: this model (attention.backend flexformer) decodes from recurrent states and "
                                  "has no KV cache to compress; set serve.kv_policy=full",
                                  s.kv_policy.empty() ? "kv.policy" : "serve.kv_policy", m.limits.default_policy));
  }
  if (m.limits.recurrent && m.scheduler->state_bytes() > o.kv_memory_bytes) {
    throw ConfigError(fmt::format("serve.kv_memory_bytes {}: a session of this model (attention.backend flexformer) "
                                  "holds {} bytes of recurrent states, so no request could ever be admitted",
                                  o.kv_memory_bytes, m.scheduler->state_bytes()));
  }
  m.page = serve::page_html(m.limits.recurrent ? std::vector<std::string>{"full"} : kv_policy_names(),
                            m.limits.default_policy, m.limits.default_budget, m.model_id, m.limits.recurrent);
  m.routes();
}

Server::~Server() {
  Impl& m = *impl_;
  {
    std::lock_guard<std::mutex> lock(m.shutdown_mu);
    if (!m.listener_closed) {
      m.listener_closed = true;
      m.draining = true;
      m.scheduler->drain();
      m.http.close_listener();
    }
  }
  m.scheduler->cancel_all(ApiError{503, "the server stopped", "server_error", "", "server_shutdown"});
  if (m.shutdown_thread.joinable()) m.shutdown_thread.join();
  m.scheduler.reset();
}

int Server::bind() {
  Impl& m = *impl_;
  const ServeConfig& s = m.cfg.serve;
  // SO_REUSEADDR only: cpp-httplib's default also sets SO_REUSEPORT, with which a second server binds a port in use
  // and the kernel splits the connections between the two.
  m.http.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, reinterpret_cast<const char*>(&yes), sizeof(yes));
  });
  if (s.port == 0) {
    m.port = m.http.bind_to_any_port(s.host);
  } else {
    m.port = m.http.bind_to_port(s.host, static_cast<int>(s.port)) ? static_cast<int>(s.port) : -1;
  }
  if (m.port <= 0) {
    throw std::runtime_error(fmt::format("dcp serve: cannot listen on {}:{} (address in use, not an address of this "
                                         "machine, or a privileged port)", s.host, s.port));
  }
  if (!m.http.set_backlog(SOMAXCONN)) spdlog::warn("serve: the listen backlog stays httplib's (5): {}", std::strerror(errno));
  return m.port;
}

int Server::port() const { return impl_->port; }

void Server::run() {
  if (impl_->port <= 0) bind();
  impl_->http.listen_after_bind();
  // Every worker has finished; a listener closed by shutdown() ends listen_after_bind with false, which is the
  // normal way out here.
  std::lock_guard<std::mutex> lock(impl_->shutdown_mu);
  if (impl_->shutdown_thread.joinable()) impl_->shutdown_thread.join();
}

void Server::shutdown() {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.shutdown_mu);
  if (m.draining.exchange(true)) return;
  m.shutdown_thread = std::thread([&m] { m.graceful(); });
}

void Server::Impl::graceful() {
  spdlog::info("serve: shutting down: no new connections; {} in-flight requests have {} s to finish", in_flight.load(),
               cfg.serve.shutdown_grace_s);
  scheduler->drain();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(cfg.serve.shutdown_grace_s);
  while ((!scheduler->idle() || in_flight > 0) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (!scheduler->idle() || in_flight > 0) {
    spdlog::warn("serve: {} requests still in flight after {} s: cancelling them", in_flight.load(),
                 cfg.serve.shutdown_grace_s);
    scheduler->cancel_all(ApiError{503, "the server shut down before the completion finished", "server_error", "",
                                   "server_shutdown"});
  }
  // Closing the listener last lets requests on open connections be answered 503 meanwhile; run() returns when
  // the workers have written what they hold.
  listener_closed = true;
  http.close_listener();
}

nlohmann::json Server::Impl::kv_json(const Job& job) const {
  nlohmann::json heads = nlohmann::json::array();
  for (const auto& [l, h] : job.abstained_heads) heads.push_back({l, h});
  return {{"policy", job.request.kv_policy},
          {"budget", job.request.kv_budget},
          {"bytes", job.kv_bytes},
          {"peak_bytes", job.kv_peak_bytes},
          {"reserved_bytes", job.reserved_bytes},
          {"abstained", !job.abstained_heads.empty()},
          {"abstained_heads", heads}};
}

nlohmann::json Server::Impl::chunk_json(const Job& job, const std::string& text, const std::string& raw,
                                        const nlohmann::json& finish) const {
  nlohmann::json choice = {{"text", serve::sanitize_utf8(text)}, {"index", 0}, {"logprobs", nullptr},
                           {"finish_reason", finish}};
  if (job.request.return_bytes) {
    nlohmann::json b = nlohmann::json::array();
    for (unsigned char c : raw) b.push_back(static_cast<int>(c));
    choice["bytes"] = b;
  }
  return {{"id", job.id}, {"object", "text_completion"}, {"created", job.created}, {"model", model_id},
          {"choices", nlohmann::json::array({choice})}};
}

void Server::Impl::routes() {
  http.set_payload_max_length(static_cast<size_t>(cfg.serve.max_body_bytes));
  http.set_keep_alive_timeout(2);  // an idle keep-alive connection delays the end of a shutdown by at most this
  http.set_read_timeout(10);
  http.set_write_timeout(10);
  const auto threads = static_cast<size_t>(cfg.serve.http_threads);
  const ThreadPriority priority = parse_thread_priority(cfg.serve.http_priority, "serve.http_priority");
  http.new_task_queue = [threads, priority]() -> httplib::TaskQueue* {
    if (priority == ThreadPriority::normal) return new httplib::ThreadPool(threads);
    return new LoweredThreadPool(threads, priority);
  };
  // Errors httplib answers itself (an unknown path, a body over the limit, a request it cannot parse) get
  // OpenAI's JSON shape too.
  http.set_error_handler(httplib::Server::HandlerWithResponse([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
    ApiError e{res.status, "", "invalid_request_error", "", ""};
    if (res.status == 413) {
      e = ApiError{400, fmt::format("the request body is larger than serve.max_body_bytes = {}", cfg.serve.max_body_bytes),
                   "invalid_request_error", "body", "body_too_large"};
    } else if (res.status == 404) {
      e.message = fmt::format("no route {} {} (POST /v1/completions, GET /v1/models, /health, /metrics, /)", req.method,
                              req.path);
      e.code = "not_found";
    } else {
      e.message = fmt::format("the request could not be read (HTTP {})", res.status);
      e.code = "bad_request";
    }
    res.status = e.status;
    res.set_content(dump(e.json()), "application/json");
    if (req.path == "/v1/completions") metrics.request(e.status);
    return httplib::Server::HandlerResponse::Handled;
  }));
  http.set_exception_handler([this](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "unknown error";
    try {
      if (ep) std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    spdlog::error("serve: a handler failed: {}", what);
    reply_error(res, ApiError{500, "internal server error: " + what, "server_error", "", "internal_error"});
  });
  http.Get("/", [this](const httplib::Request&, httplib::Response& res) { res.set_content(page, "text/html; charset=utf-8"); });
  http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    if (draining) {
      res.status = 503;
      res.set_content(R"({"status":"shutting_down"})", "application/json");
    } else {
      res.set_content(R"({"status":"ok"})", "application/json");
    }
  });
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics.text(scheduler->gauges()), "text/plain; version=0.0.4");
  });
  http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    nlohmann::json model = {{"id", model_id}, {"object", "model"}, {"created", 0}, {"owned_by", "dcp"},
                            {"max_context", limits.max_context}, {"kv_policy", limits.default_policy},
                            {"kv_budget", limits.default_budget},
                            {"kv_policies", limits.recurrent ? std::vector<std::string>{"full"} : kv_policy_names()},
                            {"attention", limits.recurrent ? "flexformer" : "softmax"},
                            {"kv_memory_bytes", cfg.serve.kv_memory_bytes}};
    res.set_content(dump({{"object", "list"}, {"data", nlohmann::json::array({model})}}), "application/json");
  });
  http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) { completions(req, res); });
}

void Server::Impl::completions(const httplib::Request& req, httplib::Response& res) {
  if (draining) return reply_error(res, ApiError{503, "the server is shutting down", "server_error", "", "server_shutting_down"});
  std::shared_ptr<KvPolicy> policy;
  auto parsed = serve::parse_completion_request(req.body, limits, policy);
  if (auto* e = std::get_if<ApiError>(&parsed)) return reply_error(res, *e);
  auto job = std::make_shared<Job>();
  job->request = std::move(std::get<serve::CompletionRequest>(parsed));
  job->policy = std::move(policy);
  job->id = fmt::format("cmpl-{:x}{:06x}", static_cast<uint64_t>(std::time(nullptr)), next_id++);
  job->created = static_cast<int64_t>(std::time(nullptr));
  job->arrived = serve::Clock::now();
  if (!job->request.seed_given) {
    static std::mutex rd_mu;
    static std::random_device rd;
    std::lock_guard<std::mutex> lock(rd_mu);
    // Below 2^53: a JavaScript client reads it back exactly.
    job->request.seed = ((static_cast<uint64_t>(rd()) << 21) ^ rd()) & ((uint64_t{1} << 53) - 1);
  }
  if (auto e = scheduler->submit(job)) return reply_error(res, *e);
  ++in_flight;
  if (!job->request.stream) {
    std::unique_lock<std::mutex> lock(job->mu);
    job->cv.wait(lock, [&] { return job->finished; });
    --in_flight;
    if (job->error) {
      lock.unlock();
      return reply_error(res, *job->error);
    }
    nlohmann::json body = chunk_json(*job, (job->request.echo ? job->request.prompt : "") + job->text, job->text,
                                     job->finish_reason);
    body["usage"] = {{"prompt_tokens", job->request.prompt.size()}, {"completion_tokens", job->generated},
                     {"total_tokens", static_cast<int64_t>(job->request.prompt.size()) + job->generated}};
    body["kv_cache"] = kv_json(*job);
    body["seed"] = job->request.seed;
    lock.unlock();
    res.set_content(dump(body), "application/json");
    metrics.request(200);
    return;
  }
  // Server-sent events: one `data: {json}` per piece of text as the scheduler releases it, the finish reason and
  // the cache in the last chunk, then `data: [DONE]`. A client that goes away cancels the session.
  struct Stream {
    size_t sent = 0;
    bool echoed = false;
  };
  auto st = std::make_shared<Stream>();
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, job, st](size_t, httplib::DataSink& sink) {
        auto event = [&](const nlohmann::json& j) {
          const std::string line = "data: " + dump(j) + "\n\n";
          return sink.write(line.data(), line.size());
        };
        if (!st->echoed) {
          st->echoed = true;
          if (job->request.echo && !job->request.prompt.empty() &&
              !event(chunk_json(*job, job->request.prompt, job->request.prompt, nullptr))) {
            job->cancel = true;
            return false;
          }
        }
        std::unique_lock<std::mutex> lock(job->mu);
        while (true) {
          // Under the lock only copies: the scheduler takes this mutex for every session at every step, and this
          // thread runs lowered (serve.http_priority), so the JSON is built after unlocking. A finished job's
          // fields no longer change (finish_job sets finished last), so that path reads them unlocked too.
          size_t upto = job->releasable;
          if (!job->finished) {
            // utf8_complete_prefix looks at most 3 bytes back: the text before them is not copied.
            const size_t tail = std::min<size_t>(upto, 3);
            upto = upto - tail + serve::utf8_complete_prefix(job->text.substr(upto - tail, tail));
          }
          if (upto > st->sent || job->finished) {
            const std::string piece = upto > st->sent ? job->text.substr(st->sent, upto - st->sent) : "";
            st->sent = std::max(st->sent, upto);
            if (!job->finished) {
              const int64_t kv_bytes = job->kv_bytes;
              lock.unlock();
              nlohmann::json j = chunk_json(*job, piece, piece, nullptr);
              j["kv_cache"] = {{"bytes", kv_bytes}};
              if (!event(j)) {
                job->cancel = true;
                return false;
              }
              return true;
            }
            // Finished: what is left, then the end.
            lock.unlock();
            std::vector<nlohmann::json> events;
            if (job->error) {
              if (!piece.empty()) events.push_back(chunk_json(*job, piece, piece, nullptr));
              events.push_back(job->error->json());
            } else {
              nlohmann::json last = chunk_json(*job, piece, piece, job->finish_reason);
              last["kv_cache"] = kv_json(*job);
              last["seed"] = job->request.seed;
              nlohmann::json usage = {{"prompt_tokens", job->request.prompt.size()},
                                      {"completion_tokens", job->generated},
                                      {"total_tokens", static_cast<int64_t>(job->request.prompt.size()) + job->generated}};
              if (job->request.include_usage) {
                events.push_back(last);
                nlohmann::json u = {{"id", job->id}, {"object", "text_completion"}, {"created", job->created},
                                    {"model", model_id}, {"choices", nlohmann::json::array()}, {"usage", usage}};
                events.push_back(u);
              } else {
                last["usage"] = usage;
                events.push_back(last);
              }
            }
            for (const auto& e : events) {
              if (!event(e)) {
                return false;
              }
            }
            static const std::string done = "data: [DONE]\n\n";
            if (!sink.write(done.data(), done.size())) return false;
            sink.done();
            return true;
          }
          job->cv.wait_for(lock, std::chrono::milliseconds(50));
          if (!job->finished && job->releasable <= st->sent) {
            lock.unlock();
            if (!sink.is_writable()) {  // the client closed the connection: cancel, and the cache goes
              job->cancel = true;
              return false;
            }
            lock.lock();
          }
        }
      },
      [this, job](bool success) {
        if (!success) job->cancel = true;
        metrics.request(200);
        --in_flight;
      });
}

}  // namespace dcp
