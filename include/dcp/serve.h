// dcp serve: an HTTP server with the OpenAI completions API over a softmax checkpoint, continuous batching and a
// server-wide KV memory budget (docs/serve.md).
#pragma once

#include <memory>
#include <string>

#include "dcp/config.h"
#include "dcp/model.h"

namespace dcp {

/// The server: cpp-httplib on serve.host:serve.port, one scheduler thread that owns the model and every session
/// (each a DecodeSession with the request's KV policy), batching every active session's step into one forward
/// (serve.scheduler batched) and admitting requests while their KV reservations fit serve.kv_memory_bytes.
/// Routes: POST /v1/completions, GET /v1/models, /health, /metrics (Prometheus text) and / (the web page).
class Server {
 public:
  /// `model`: a softmax model with its weights loaded (its parameters are not changed); `cfg`: the checkpoint's
  /// config with serve.* and kv.* resolved (serve.kv_policy "" = kv.policy, serve.kv_budget 0 = kv.budget,
  /// serve.chunk_tokens 0 = kv.chunk_tokens, serve.max_context 0 = data.max_seq_len); `model_id` names the model
  /// in responses and /v1/models. Throws ConfigError for a default policy or budget that make_kv_policy refuses
  /// and std::invalid_argument for a model that is not softmax.
  Server(Transformer model, const Config& cfg, std::string model_id);
  /// Stops at once (shutdown without grace) if still running.
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  /// Binds serve.host:serve.port (port 0: an ephemeral one) and returns the port. Throws std::runtime_error
  /// naming host and port when the address cannot be bound.
  int bind();
  /// Serves until shutdown() has finished: returns once every connection is answered and closed.
  void run();
  /// The graceful shutdown of SIGTERM: the listening socket closes (no new connection), requests on open
  /// connections are answered 503, in-flight requests may finish for serve.shutdown_grace_s, then the rest are
  /// cancelled (a stream gets an error event, a waiting request a 503). Returns at once; run() returns when done.
  /// Safe to call from any thread, more than once; not from a signal handler.
  void shutdown();
  int port() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dcp
