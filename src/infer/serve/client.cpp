#include "infer/serve/client.h"

#include <httplib.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace dcp::serve {
namespace {

void set_timeouts(httplib::Client& c, double timeout_s) {
  const auto us = std::chrono::microseconds(static_cast<int64_t>(timeout_s * 1e6));
  c.set_connection_timeout(us);
  c.set_read_timeout(us);
  c.set_write_timeout(us);
}

}  // namespace

ClientReply complete(const std::string& host, int port, const nlohmann::json& body, double timeout_s,
                     const std::function<bool(const ClientReply&)>& on_event) {
  httplib::Client c(host, port);
  set_timeouts(c, timeout_s);
  ClientReply r;
  const bool stream = body.value("stream", false) == true;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body.dump();
  req.set_header("Content-Type", "application/json");
  const auto start = std::chrono::steady_clock::now();
  std::string pending;
  // Without on_event nobody reads an event before the stream ends: each is kept as its raw payload with its
  // arrival time and parsed after the last, so that the reading thread (a benchmark's client, on the server's
  // cores) spends what it must on each event (a copy and a clock read) and no JSON parsing while it streams.
  std::vector<std::string> raw;
  auto take = [&r](const std::string& payload) {
    nlohmann::json j = nlohmann::json::parse(payload, nullptr, false);
    if (j.contains("choices") && j["choices"].is_array() && !j["choices"].empty()) {
      const auto& ch = j["choices"][0];
      r.text += ch.value("text", "");
      if (ch.contains("bytes")) {
        for (const auto& b : ch["bytes"]) r.bytes.push_back(static_cast<char>(b.get<int>()));
      }
      if (ch.contains("finish_reason") && !ch["finish_reason"].is_null()) r.last = j;
    }
    r.events.push_back(std::move(j));
  };
  if (stream) {
    req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
      const double at = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      r.body.append(data, n);
      pending.append(data, n);
      size_t from = 0, cut;
      while ((cut = pending.find("\n\n", from)) != std::string::npos) {
        const size_t line = from;
        from = cut + 2;
        if (pending.compare(line, 6, "data: ") != 0 || cut < line + 6) continue;
        std::string payload = pending.substr(line + 6, cut - line - 6);
        if (payload == "[DONE]") {
          r.done = true;
          continue;
        }
        r.event_s.push_back(at);
        if (on_event) {
          take(payload);
          if (!on_event(r)) return false;
        } else {
          raw.push_back(std::move(payload));
        }
      }
      pending.erase(0, from);
      return true;
    };
  }
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  const bool sent = c.send(req, res, err);
  for (const std::string& payload : raw) take(payload);  // what arrived, also when the stream broke off
  if (!sent && res.status <= 0) {
    r.error = httplib::to_string(err);
    return r;
  }
  r.status = res.status;
  r.retry_after = res.get_header_value("Retry-After");
  if (!stream || res.status != 200) {
    if (!stream) r.body = res.body;
    if (r.body.empty()) r.body = res.body;
    r.json = nlohmann::json::parse(r.body, nullptr, false);
  }
  return r;
}

std::pair<int, std::string> get(const std::string& host, int port, const std::string& path, double timeout_s) {
  httplib::Client c(host, port);
  set_timeouts(c, timeout_s);
  auto res = c.Get(path.c_str());
  if (!res) return {0, httplib::to_string(res.error())};
  return {res->status, res->body};
}

double metric(const std::string& text, const std::string& name, const std::string& labels) {
  std::istringstream in(text);
  std::string line;
  const std::string key = labels.empty() ? name : name + "{" + labels + "}";
  while (std::getline(in, line)) {
    if (line.rfind(key + " ", 0) == 0) return std::stod(line.substr(key.size() + 1));
  }
  return std::numeric_limits<double>::quiet_NaN();
}

}  // namespace dcp::serve
