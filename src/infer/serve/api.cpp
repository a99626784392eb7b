#include "infer/serve/api.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <set>

namespace dcp::serve {

nlohmann::json ApiError::json() const {
  nlohmann::json e = {{"message", message}, {"type", type}, {"param", nullptr}, {"code", nullptr}};
  if (!param.empty()) e["param"] = param;
  if (!code.empty()) e["code"] = code;
  return {{"error", e}};
}

namespace {

ApiError bad(const std::string& param, const std::string& message, const std::string& code = "invalid_value") {
  return ApiError{400, message, "invalid_request_error", param, code};
}

std::string type_name(const nlohmann::json& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return "a boolean";
  if (v.is_number_integer() || v.is_number_unsigned()) return "an integer";
  if (v.is_number_float()) {
    const double x = v.get<double>();
    return std::isfinite(x) && std::floor(x) == x ? "a number" : "a number with a fraction";
  }
  if (v.is_string()) return "a string";
  if (v.is_array()) return "an array";
  return "an object";
}

// A value for an error message: scalars as JSON (strings cut to 64 bytes), arrays and objects by their type only:
// dump() recurses through the nesting, and a 200 KB body of nested arrays would overflow the worker's stack.
std::string brief(const nlohmann::json& v) {
  if (v.is_structured()) return type_name(v);
  std::string d = v.dump();
  if (d.size() > 64) d = d.substr(0, 64) + "...";
  return d;
}

ApiError wrong_type(const std::string& param, const std::string& wanted, const nlohmann::json& v) {
  return bad(param, fmt::format("'{}' must be {}, got {}", param, wanted, type_name(v)), "invalid_type");
}

// The value of an integer field: a JSON integer, or a number written as a float whose value is whole (16.0, 1e30:
// JSON does not tell them apart, and 1e30 is out of range rather than of another type), as a double (exact
// below 2^53, which is where every range checked here ends); nullopt for a number with a fraction or anything
// else than a number.
std::optional<double> whole_number(const nlohmann::json& v) {
  if (v.is_number_integer()) return static_cast<double>(v.get<int64_t>());
  if (v.is_number_unsigned()) return static_cast<double>(v.get<uint64_t>());
  if (!v.is_number_float()) return std::nullopt;
  const double x = v.get<double>();
  if (!std::isfinite(x) || std::floor(x) != x) return std::nullopt;
  return x;
}

// A JSON number as a finite double (integers too); nullopt for anything else.
std::optional<double> number(const nlohmann::json& v) {
  if (!v.is_number()) return std::nullopt;
  const double x = v.get<double>();
  if (!std::isfinite(x)) return std::nullopt;
  return x;
}

}  // namespace

std::variant<CompletionRequest, ApiError> parse_completion_request(const std::string& body, const RequestLimits& limits,
                                                                   std::shared_ptr<KvPolicy>& policy) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(body);
  } catch (const nlohmann::json::exception& e) {  // a syntax error, or a number out of range (1e999)
    return bad("", fmt::format("the request body is not valid JSON: {}", e.what()), "invalid_json");
  }
  if (!j.is_object()) return bad("", fmt::format("the request body must be a JSON object, got {}", type_name(j)), "invalid_json");
  static const std::set<std::string> known = {
      "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
      "echo", "n", "best_of", "logprobs", "suffix", "logit_bias", "presence_penalty", "frequency_penalty", "user",
      "kv_policy", "kv_budget", "kv_options", "return_bytes"};
  for (const auto& item : j.items()) {
    if (known.count(item.key()) == 0) {
      return bad(item.key(), fmt::format("unrecognized request argument '{}' (docs/serve.md lists the fields)",
                                         item.key()), "unknown_field");
    }
  }
  auto has = [&](const char* key) { return j.contains(key) && !j.at(key).is_null(); };
  CompletionRequest r;
  if (has("model")) {
    if (!j["model"].is_string()) return wrong_type("model", "a string", j["model"]);
    const std::string m = j["model"].get<std::string>();
    if (!m.empty() && m != limits.model_id) {
      return ApiError{404, fmt::format("the model '{}' does not exist; this server serves '{}'", m, limits.model_id),
                      "invalid_request_error", "model", "model_not_found"};
    }
  }
  if (!has("prompt")) return bad("prompt", "'prompt' is required (a string)", "missing_field");
  if (!j["prompt"].is_string()) return wrong_type("prompt", "a string (this byte-level model takes text)", j["prompt"]);
  r.prompt = j["prompt"].get<std::string>();
  if (static_cast<int64_t>(r.prompt.size()) > limits.max_prompt_bytes) {
    return bad("prompt", fmt::format("'prompt' has {} bytes, more than serve.max_prompt_bytes = {}", r.prompt.size(),
                                     limits.max_prompt_bytes), "prompt_too_long");
  }
  r.max_tokens = limits.default_max_tokens;
  if (has("max_tokens")) {
    const auto& v = j["max_tokens"];
    const auto m = whole_number(v);
    if (!m) return wrong_type("max_tokens", "an integer", v);
    if (*m < 1 || *m > static_cast<double>(limits.max_tokens)) {
      return bad("max_tokens", fmt::format("'max_tokens' must be in [1, {}] (serve.max_tokens), got {}", limits.max_tokens,
                                           brief(v)));
    }
    r.max_tokens = static_cast<int64_t>(*m);
  }
  if (has("temperature")) {
    const auto x = number(j["temperature"]);
    if (!j["temperature"].is_number()) return wrong_type("temperature", "a number", j["temperature"]);
    if (!x || *x < 0 || *x > 100) {
      return bad("temperature", fmt::format("'temperature' must be a finite number in [0, 100] (0 = greedy), got {}",
                                            brief(j["temperature"])));
    }
    r.sampling.temperature = *x;
  }
  if (has("top_p")) {
    const auto x = number(j["top_p"]);
    if (!j["top_p"].is_number()) return wrong_type("top_p", "a number", j["top_p"]);
    if (!x || !(*x > 0) || *x > 1) {
      return bad("top_p", fmt::format("'top_p' must be a number in (0, 1], got {}", brief(j["top_p"])));
    }
    r.sampling.top_p = *x;
  }
  if (has("top_k")) {
    const auto& v = j["top_k"];
    const auto k = whole_number(v);
    if (!k) return wrong_type("top_k", "an integer", v);
    if (*k < 0 || *k > 256) return bad("top_k", fmt::format("'top_k' must be in [0, 256] (0 = every byte), got {}", brief(v)));
    r.sampling.top_k = static_cast<int64_t>(*k);
  }
  if (has("seed")) {
    const auto& v = j["seed"];
    const auto x = whole_number(v);
    if (!x) return wrong_type("seed", "an integer", v);
    // 2^64 is exact as a double: a float seed at or above it does not fit the generator's 64 bits.
    if (*x < 0 || *x >= 18446744073709551616.0) {
      return bad("seed", fmt::format("'seed' must be in [0, 2^64 - 1], got {}", brief(v)));
    }
    r.seed = v.is_number_unsigned() ? v.get<uint64_t>() : static_cast<uint64_t>(*x);
    r.seed_given = true;
  }
  if (has("stop")) {
    const auto& v = j["stop"];
    std::vector<nlohmann::json> items;
    if (v.is_string()) {
      items.push_back(v);
    } else if (v.is_array()) {
      if (v.size() > 4) return bad("stop", fmt::format("'stop' holds at most 4 sequences, got {}", v.size()));
      for (const auto& x : v) items.push_back(x);
    } else {
      return wrong_type("stop", "a string or a list of strings", v);
    }
    for (const auto& x : items) {
      if (!x.is_string()) return wrong_type("stop", "a string or a list of strings", x);
      if (x.get<std::string>().empty()) return bad("stop", "'stop' sequences must not be empty");
      r.stop.push_back(x.get<std::string>());
    }
  }
  auto flag = [&](const char* key, bool& out) -> std::optional<ApiError> {
    if (!has(key)) return std::nullopt;
    if (!j[key].is_boolean()) return wrong_type(key, "a boolean", j[key]);
    out = j[key].get<bool>();
    return std::nullopt;
  };
  for (const auto& [key, out] : {std::pair<const char*, bool*>{"stream", &r.stream}, {"echo", &r.echo},
                                  {"return_bytes", &r.return_bytes}}) {
    if (auto e = flag(key, *out)) return *e;
  }
  if (has("stream_options")) {
    const auto& v = j["stream_options"];
    if (!v.is_object()) return wrong_type("stream_options", "an object", v);
    if (!r.stream) return bad("stream_options", "'stream_options' is only allowed with \"stream\": true");
    for (const auto& item : v.items()) {
      if (item.key() != "include_usage") {
        return bad("stream_options", fmt::format("unrecognized stream option '{}' (only include_usage)", item.key()),
                   "unknown_field");
      }
      if (!item.value().is_boolean()) return wrong_type("stream_options", "{\"include_usage\": a boolean}", item.value());
      r.include_usage = item.value().get<bool>();
    }
  }
  // Accepted only at the value that changes nothing: this server draws one choice per request, without
  // log-probabilities, suffixes, biases or penalties.
  for (const char* key : {"n", "best_of"}) {
    if (!has(key)) continue;
    if (!j[key].is_number_integer() || j[key].get<int64_t>() != 1) {
      return bad(key, fmt::format("'{}' must be 1 (one choice per request), got {}", key, brief(j[key])), "unsupported");
    }
  }
  for (const char* key : {"logprobs", "suffix"}) {
    if (has(key)) return bad(key, fmt::format("'{}' is not supported", key), "unsupported");
  }
  if (has("logit_bias") && !(j["logit_bias"].is_object() && j["logit_bias"].empty())) {
    return bad("logit_bias", "'logit_bias' is not supported", "unsupported");
  }
  for (const char* key : {"presence_penalty", "frequency_penalty"}) {
    if (!has(key)) continue;
    const auto x = number(j[key]);
    if (!x || *x != 0) return bad(key, fmt::format("'{}' is not supported (only 0)", key), "unsupported");
  }
  if (has("user") && !j["user"].is_string()) return wrong_type("user", "a string", j["user"]);

  // The KV cache: the request's policy, budget and options, else the server's defaults (a named "full" keeps
  // everything, whatever the default budget).
  r.kv_policy = limits.default_policy;
  r.kv_budget = limits.default_budget;
  const bool policy_given = has("kv_policy");
  if (policy_given) {
    if (!j["kv_policy"].is_string()) return wrong_type("kv_policy", "a string", j["kv_policy"]);
    r.kv_policy = j["kv_policy"].get<std::string>();
    if (r.kv_policy == "full") r.kv_budget = 1;
  }
  if (has("kv_budget")) {
    const auto x = number(j["kv_budget"]);
    if (!j["kv_budget"].is_number()) return wrong_type("kv_budget", "a number", j["kv_budget"]);
    if (!x) return bad("kv_budget", fmt::format("'kv_budget' must be finite, got {}", brief(j["kv_budget"])));
    r.kv_budget = *x;
  }
  if (has("kv_options")) {
    const auto& v = j["kv_options"];
    if (!v.is_object()) return wrong_type("kv_options", "an object of option names to numbers", v);
    for (const auto& item : v.items()) {
      const auto x = number(item.value());
      if (!x) {
        return bad("kv_options", fmt::format("kv_options '{}' must be a finite number, got {}", item.key(),
                                             brief(item.value())));
      }
      r.kv_options[item.key()] = *x;
    }
  }
  if (limits.recurrent) {
    // A flexformer model's session holds fixed-size recurrent states: nothing grows, so nothing is compressed.
    const char* why = "this model (attention.backend flexformer) decodes from recurrent states of a fixed size per "
                      "session and has no KV cache to compress";
    if (r.kv_policy != "full") {
      return bad("kv_policy", fmt::format("'kv_policy' {}: {}; use full or leave it out", r.kv_policy, why),
                 "unsupported_policy");
    }
    if (has("kv_budget") && r.kv_budget != 1) {
      return bad("kv_budget", fmt::format("'kv_budget' {}: {}; use 1 or leave it out", r.kv_budget, why),
                 "unsupported_policy");
    }
    if (!r.kv_options.empty()) {
      return bad("kv_options", fmt::format("'kv_options' {}: {}; leave them out", r.kv_options.begin()->first, why),
                 "unsupported_policy");
    }
  }
  try {
    make_kv_policy(r.kv_policy);
  } catch (const std::invalid_argument& e) {
    return bad("kv_policy", e.what(), "unknown_policy");
  }
  try {
    make_kv_policy_with_budget(r.kv_policy, r.kv_budget);
  } catch (const std::invalid_argument& e) {
    return bad("kv_budget", e.what());
  }
  if (const auto it = r.kv_options.find("max_rel_error"); it != r.kv_options.end() && it->second != 0) {
    return bad("kv_options", fmt::format("max_rel_error {}: error targets are not served (admission reserves a "
                                         "session's cache by its kv_budget, which a target does not fix)",
                                         it->second));
  }
  try {
    policy = make_kv_policy_with_budget(r.kv_policy, r.kv_budget, r.kv_options);
  } catch (const std::invalid_argument& e) {
    return bad("kv_options", e.what());
  }
  const int64_t needed = 1 + static_cast<int64_t>(r.prompt.size()) + r.max_tokens;
  if (needed > limits.max_context) {
    return bad("max_tokens", fmt::format("this model's maximum context is {} tokens (serve.max_context); the request "
                                         "needs {} (BOS + {} prompt bytes + max_tokens {})",
                                         limits.max_context, needed, r.prompt.size(), r.max_tokens),
               "context_length_exceeded");
  }
  return r;
}

std::string sanitize_utf8(const std::string& b) {
  std::string out;
  out.reserve(b.size());
  size_t i = 0;
  const auto u = [&](size_t k) { return static_cast<unsigned char>(b[k]); };
  while (i < b.size()) {
    const unsigned char c = u(i);
    size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    bool ok = len > 0 && i + len <= b.size();
    for (size_t k = 1; ok && k < len; ++k) ok = (u(i + k) & 0xC0) == 0x80;
    if (ok && len > 1) {
      // Overlong forms, surrogates and code points above U+10FFFF are invalid too (RFC 3629).
      uint32_t cp = c & (0xFF >> (len + 1));
      for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (u(i + k) & 0x3F);
      const uint32_t min[] = {0, 0, 0x80, 0x800, 0x10000};
      ok = cp >= min[len] && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF);
    }
    if (ok) {
      out.append(b, i, len);
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      i += 1;
    }
  }
  return out;
}

size_t utf8_complete_prefix(const std::string& b) {
  // Look at most 3 bytes back for a lead byte whose sequence runs past the end.
  const size_t n = b.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const unsigned char c = static_cast<unsigned char>(b[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const size_t len = (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 1;
    return len > back ? n - back : n;
  }
  return n;
}

}  // namespace dcp::serve
