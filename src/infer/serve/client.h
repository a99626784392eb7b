// A small client of dcp serve's API over cpp-httplib, for the tests and `dcp bench-serve`: one completion
// answered whole, or streamed with the arrival time of every server-sent event.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace dcp::serve {

struct ClientReply {
  int status = 0;              ///< HTTP status; 0 = no answer (connection refused, time-out)
  std::string error;           ///< httplib's error when status is 0
  std::string body;            ///< the whole body (a stream's raw text included)
  std::string retry_after;     ///< the Retry-After header of a 503
  nlohmann::json json;         ///< the body parsed (non-streaming), else null
  // Streaming:
  std::vector<nlohmann::json> events;  ///< every `data:` event but [DONE], parsed
  std::vector<double> event_s;         ///< when each arrived, seconds after the request was sent
  bool done = false;                   ///< `data: [DONE]` was received
  std::string text;                    ///< the streamed choices' text, concatenated
  std::string bytes;                   ///< the streamed choices' "bytes" (return_bytes), concatenated
  nlohmann::json last;                 ///< the event carrying finish_reason (null if none)
};

/// POSTs `body` to /v1/completions on host:port. With body.stream true the events are read as they come, each
/// timed at the arrival of the bytes that completed it (event_s); with `on_event` each is parsed at once and
/// `on_event(reply)` called after it, which may return false to close the connection (a client that leaves);
/// without, the events are kept raw and parsed after the stream ends (also when it broke off), so that reading a
/// stream costs a copy and a clock read per event.
/// `timeout_s` bounds every read and write.
ClientReply complete(const std::string& host, int port, const nlohmann::json& body, double timeout_s = 30,
                     const std::function<bool(const ClientReply&)>& on_event = {});

/// GETs `path`; returns status and body (status 0 when no answer).
std::pair<int, std::string> get(const std::string& host, int port, const std::string& path, double timeout_s = 10);

/// The value of metric `name` (a line "name value", or "name{labels} value" with `labels`) in Prometheus text;
/// NaN when absent.
double metric(const std::string& text, const std::string& name, const std::string& labels = "");

}  // namespace dcp::serve
