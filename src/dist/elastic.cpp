// `dcp launch --max-restarts N` (src/dist/elastic.h): rounds of this node's ranks over the launchers' store.
#include "dist/elastic.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <stdlib.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <stdexcept>
#include <thread>

#include "dist/c10d_compat.h"
#include "dist/launch_round.h"
#include "util/error_message.h"

namespace dcp {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr double kOpTimeoutS = 3;    // one store operation (or connection attempt) of a launcher
constexpr double kAckWaitS = 10;     // node 0 keeps the store up this long for the others to read the verdict

Clock::time_point after(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// The launchers' store: node 0 serves it; the others are clients that reconnect after any failed operation (each
// operation and connection attempt is bounded by kOpTimeoutS, so an unreachable node 0 never blocks a launcher).
class LaunchStore {
 public:
  LaunchStore(std::string host, int port, bool serve) : host_(std::move(host)), port_(port), serve_(serve) {
    if (serve_) store_ = make_agent_store(host_, port_, true, kOpTimeoutS);  // a port in use: thrown at once
  }
  bool reachable() { return ensure(); }
  // The value of `key`, nullopt when it is missing or the store cannot be reached (then lost() is true).
  std::optional<std::string> get(const std::string& key) {
    if (!ensure()) return std::nullopt;
    try {
      if (!store_->check({prefix_ + key})) return std::nullopt;
      const auto v = store_->get(prefix_ + key);
      return std::string(v.begin(), v.end());
    } catch (const std::exception& e) {
      drop(e);
      return std::nullopt;
    }
  }
  bool set(const std::string& key, const std::string& value) {
    if (!ensure()) return false;
    try {
      store_->set(prefix_ + key, std::vector<uint8_t>(value.begin(), value.end()));
      return true;
    } catch (const std::exception& e) {
      drop(e);
      return false;
    }
  }
  // Sets `key` unless it is set already; returns the value it holds then (nullopt: unreachable).
  std::optional<std::string> first(const std::string& key, const std::string& value) {
    if (!ensure()) return std::nullopt;
    try {
      const auto v = store_->compareSet(prefix_ + key, {}, std::vector<uint8_t>(value.begin(), value.end()));
      return std::string(v.begin(), v.end());
    } catch (const std::exception& e) {
      drop(e);
      return std::nullopt;
    }
  }
  // Raises the whole number under `key` to at least `n`.
  void raise(const std::string& key, int64_t n) {
    for (int attempt = 0; attempt < 20; ++attempt) {
      const auto cur = get(key);
      if (lost_) return;
      if (cur && std::stoll(*cur) >= n) return;
      if (!ensure()) return;
      try {
        const std::vector<uint8_t> expected = cur ? std::vector<uint8_t>(cur->begin(), cur->end()) : std::vector<uint8_t>{};
        const std::string want = std::to_string(n);
        store_->compareSet(prefix_ + key, expected, std::vector<uint8_t>(want.begin(), want.end()));
      } catch (const std::exception& e) {
        drop(e);
        return;
      }
    }
  }
  bool lost() const { return lost_; }

 private:
  bool ensure() {
    if (store_.defined()) return true;
    if (serve_ || Clock::now() < next_attempt_) return false;
    next_attempt_ = after(1.0);  // a failed attempt takes up to kOpTimeoutS: at most one a second
    try {
      store_ = make_agent_store(host_, port_, false, kOpTimeoutS);
      lost_ = false;
      if (!warned_.empty()) fmt::print(stderr, "dcp launch: reached the launchers' store at {}:{} again\n", host_, port_);
      warned_.clear();
      return true;
    } catch (const std::exception& e) {
      drop(e);
      return false;
    }
  }
  void drop(const std::exception& e) {
    lost_ = true;
    store_.reset();
    if (warned_.empty()) {
      warned_ = error_message(e);
      fmt::print(stderr, "dcp launch: lost the launchers' store at {}:{} ({}); retrying\n", host_, port_,
                 warned_.substr(0, warned_.find('\n')));
    }
  }
  const std::string prefix_ = "dcp/launch/";
  std::string host_;
  int port_;
  bool serve_;
  c10::intrusive_ptr<c10d::Store> store_;
  bool lost_ = false;
  std::string warned_;
  Clock::time_point next_attempt_{};
};

json parse(const std::optional<std::string>& text) {
  return text ? json::parse(*text, nullptr, /*allow_exceptions=*/false) : json();
}

int severity(const std::string& kind) {
  if (kind == "launcher_signal") return 6;
  if (kind == "usage") return 5;
  if (kind == "checkpoint_refused") return 4;
  if (kind == "nonfinite") return 3;
  if (kind == "signal") return 2;  // a rank killed: usually the cause of its peers' "runtime" errors
  if (kind == "runtime") return 1;
  return 0;                        // lost_node
}

// Why a failure of `kind` is not restarted, "" when it may be.
std::string no_restart_reason(const std::string& kind) {
  if (kind == "usage") return "a usage or config error (exit 2) would come again";
  if (kind == "checkpoint_refused") return "the checkpoint was refused, and would be again";
  if (kind == "launcher_signal") return "a launcher was told to stop";
  return "";
}

bool is_train(const std::vector<std::string>& command) { return !command.empty() && command[0] == "train"; }

bool has_flag(const std::vector<std::string>& command, const std::string& flag) {
  for (const auto& a : command) {
    if (a == flag) return true;
  }
  return false;
}

struct Verdict {
  std::string action;  // done | restart | give_up
  int code = 0;
  Failure failure;
  std::string reason;
};

json to_json(const Verdict& v) {
  return {{"action", v.action}, {"code", v.code}, {"failure", v.failure.to_json()}, {"reason", v.reason}};
}

Verdict verdict_of(const json& j) {
  Verdict v;
  v.action = j.value("action", "give_up");
  v.code = j.value("code", 1);
  v.failure = Failure::from_json(j.contains("failure") ? j["failure"] : json());
  v.reason = j.value("reason", "");
  return v;
}

class ElasticLaunch {
 public:
  explicit ElasticLaunch(const LaunchOptions& opt)
      : opt_(opt),
        host_(opt.node_rank == 0),
        addr_(opt.master_addr.empty() ? "127.0.0.1" : opt.master_addr),
        port_(opt.master_port != 0 ? opt.master_port : free_loopback_port()),
        store_(addr_, port_, host_),
        given_resume_(has_flag(opt.command, "--resume")) {
    std::random_device rd;
    nonce_ = fmt::format("{}-{}", getpid(), rd());
    char tmpl[] = "/tmp/dcp-launch-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) throw std::runtime_error("dcp launch: cannot create a folder for the ranks' error files");
    errors_dir_ = tmpl;
  }
  ~ElasticLaunch() {
    std::error_code ignored;
    fs::remove_all(errors_dir_, ignored);
  }

  int run() {
    int64_t want = 0;
    for (;;) {
      const std::optional<int64_t> round = join(want);
      if (!round) return end_code_;
      const int64_t r = *round;
      const RoundResult result = run_round(r);
      Verdict v = host_ ? decide(r, result) : await_verdict(r, result);
      if (v.action == "done") {
        finish(r);
        return 0;
      }
      if (v.action == "give_up") {
        fmt::print(stderr, "dcp launch: the job failed: {}\ndcp launch: not restarting: {}; exit code {}\n",
                   v.failure.describe(), v.reason, v.code);
        finish(r);
        return v.code;
      }
      const auto step = known_checkpoint();
      fmt::print(stderr, "dcp launch: restart {} of at most {}: {}; {} in {:g} s\n", r + 1, opt_.max_restarts,
                 v.failure.describe(),
                 step || given_resume_ ? (step ? fmt::format("resuming from the last good checkpoint (the newest "
                                                             "written is step {})",
                                                             *step)
                                               : std::string("resuming from the checkpoint (--resume)"))
                                       : "no checkpoint was written yet: restarting from scratch",
                 opt_.restart_backoff_s);
      if (!sleep_unless_stopped(opt_.restart_backoff_s)) return 128 + stop_signal();
      want = r + 1;
    }
  }

 private:
  std::string key(int64_t r, const std::string& what) const { return fmt::format("{}/{}", r, what); }

  std::optional<int64_t> known_checkpoint() {
    if (const auto v = store_.get("checkpoint_step")) checkpoint_step_ = std::max<int64_t>(checkpoint_step_.value_or(-1), std::stoll(*v));
    return checkpoint_step_;
  }

  // What this launcher knows, raised in a store that lost it (node 0's launcher restarted).
  void republish(int64_t want) {
    store_.raise("round", want);
    if (checkpoint_step_) store_.raise("checkpoint_step", *checkpoint_step_);
  }

  // Meets the other launchers in round `want` or a later one; returns the round to run, or nullopt with end_code_.
  std::optional<int64_t> join(int64_t want) {
    const auto deadline = after(opt_.join_timeout_s);
    int64_t joined = -1;
    std::string waiting_for;
    while (Clock::now() < deadline) {
      if (stop_signal() != 0) {
        end_code_ = 128 + stop_signal();
        return std::nullopt;
      }
      if (!store_.reachable()) {
        waiting_for = fmt::format("the launchers' store at {}:{} (node 0's dcp launch)", addr_, port_);
        std::this_thread::sleep_for(std::chrono::milliseconds(500));
        continue;
      }
      republish(want);
      const auto current = store_.get("round");
      if (store_.lost() || !current) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      const int64_t r = std::stoll(*current);
      if (r > want) want = r;  // node 0 too follows a round raised by a launcher that knew a newer one
      const json start = parse(store_.get(key(want, "start")));
      if (!start.is_null()) {
        if (joined == want) {
          if (start.contains("step") && start["step"].is_number_integer() && start["step"].get<int64_t>() >= 0) {
            checkpoint_step_ = std::max<int64_t>(checkpoint_step_.value_or(-1), start["step"].get<int64_t>());
          }
          resume_ = start.value("resume", false);
          return want;
        }
        // Round `want` runs without this launcher (its predecessor was killed, and its watcher killed its ranks):
        // it cannot succeed. Say so, for the predecessor too, so that the others stop at once and node 0 decides
        // without waiting for it; take the next round once node 0 decided this one.
        const std::string status_key = key(want, fmt::format("status/{}", opt_.node_rank));
        if (!store_.get(status_key) && !store_.lost()) {
          const Failure lost{opt_.node_rank, -1, 1, "lost_node",
                             fmt::format("the launcher of node {} was restarted while rendezvous round {} ran (its ranks died "
                                         "with the previous one)",
                                         opt_.node_rank, want),
                             ""};
          store_.first(key(want, "first"), lost.to_json().dump());
          store_.set(status_key, json{{"ok", false}, {"failure", lost.to_json()}}.dump());
          store_.set(key(want, "failed"), "1");
        }
        const json decision = parse(store_.get(key(want, "decision")));
        if (!decision.is_null()) {
          const Verdict v = verdict_of(decision);
          if (v.action != "restart") {
            fmt::print(stderr, "dcp launch: rendezvous round {} of this job ended without node {}: {}\n", want, opt_.node_rank,
                       v.action == "done" ? "it succeeded" : v.failure.describe());
            end_code_ = v.code;
            return std::nullopt;
          }
          ++want;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        continue;
      }
      if (joined != want) {
        if (host_) store_.raise("round", want);
        if (!store_.set(key(want, fmt::format("join/{}", opt_.node_rank)), nonce_)) continue;
        joined = want;
      }
      if (host_) {
        std::vector<int> missing;
        for (int k = 0; k < opt_.nnodes; ++k) {
          if (!store_.get(key(want, fmt::format("join/{}", k)))) missing.push_back(k);
        }
        if (missing.empty()) {
          const auto step = known_checkpoint();
          store_.set(key(want, "start"), json{{"resume", given_resume_ || step.has_value()}, {"step", step.value_or(-1)}}.dump());
          continue;  // read back as every node does
        }
        waiting_for = fmt::format("node(s) {} to join rendezvous round {}", fmt::join(missing, ", "), want);
      } else {
        waiting_for = fmt::format("node 0 to start rendezvous round {}", want);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    fmt::print(stderr, "dcp launch: giving up: waited {:g} s (--join-timeout-s) for {}\n", opt_.join_timeout_s,
               waiting_for);
    end_code_ = 1;
    return std::nullopt;
  }

  RoundResult run_round(int64_t r) {
    RoundSetup setup;
    setup.addr = addr_;
    setup.port = port_;
    setup.command = opt_.command;
    if (resume_ && !given_resume_ && is_train(opt_.command)) setup.command.insert(setup.command.begin() + 1, "--resume");
    setup.env = {{"DCP_USE_AGENT_STORE", "1"},
                 {"DCP_RESTART_COUNT", std::to_string(r)},
                 {"DCP_MAX_RESTARTS", std::to_string(opt_.max_restarts)}};
    setup.error_file_prefix = fmt::format("{}/r{}_", errors_dir_, r);
    if (r > 0 || opt_.nnodes > 1) {
      fmt::print(stderr, "dcp launch: rendezvous round {} ({} node(s) joined): starting {} rank(s) of node {}{}\n", r,
                 opt_.nnodes, opt_.nproc, opt_.node_rank,
                 setup.command.size() > opt_.command.size() ? " with --resume" : "");
    }
    const std::string failed_key = key(r, "failed");
    int polls = 0;
    return launch_round(
        opt_, setup, watcher_,
        [&] {
          if (++polls % 4 == 0) known_checkpoint();  // kept here too, for a store that dies with node 0's launcher
          return store_.get(failed_key).has_value();
        },
        [&](const Failure& f) {
          if (store_.first(key(r, "first"), f.to_json().dump())) store_.set(failed_key, "1");
        });
  }

  json status_of(const RoundResult& result) const {
    Failure f;
    if (result.failure) f = *result.failure;
    if (result.launcher_signal != 0) {
      f = Failure{opt_.node_rank, -1, 128 + result.launcher_signal, "launcher_signal",
                  fmt::format("the launcher of node {} got signal {}", opt_.node_rank, result.launcher_signal), ""};
    }
    return {{"ok", result.ok}, {"failure", result.failure || result.launcher_signal != 0 ? f.to_json() : json()}};
  }

  // Posts this node's status (retrying while the store is unreachable, up to the join timeout).
  bool post_status(int64_t r, const RoundResult& result) {
    const auto deadline = after(opt_.join_timeout_s);
    const std::string text = status_of(result).dump();
    while (Clock::now() < deadline) {
      if (store_.set(key(r, fmt::format("status/{}", opt_.node_rank)), text)) {
        if (!result.ok) store_.set(key(r, "failed"), "1");
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
    }
    return false;
  }

  // Node 0: the verdict over every node's status (a node that reports nothing within the settle time is lost).
  Verdict decide(int64_t r, const RoundResult& own) {
    post_status(r, own);
    const auto settle = after(opt_.grace_s + 10);
    const auto patience = after(opt_.join_timeout_s);
    std::vector<json> statuses(static_cast<size_t>(opt_.nnodes));
    for (;;) {
      bool all = true, failed = false;
      for (int k = 0; k < opt_.nnodes; ++k) {
        if (statuses[static_cast<size_t>(k)].is_null()) statuses[static_cast<size_t>(k)] = parse(store_.get(key(r, fmt::format("status/{}", k))));
        const json& s = statuses[static_cast<size_t>(k)];
        all = all && !s.is_null();
        failed = failed || (!s.is_null() && !s.value("ok", false));
      }
      failed = failed || store_.get(key(r, "failed")).has_value();
      if (all || (failed && Clock::now() > settle) || Clock::now() > patience || stop_signal() != 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    Verdict v;
    std::optional<Failure> chosen;
    const json first = parse(store_.get(key(r, "first")));
    auto consider = [&](const Failure& f) {
      if (!chosen || severity(f.kind) > severity(chosen->kind)) chosen = f;
    };
    if (first.is_object()) consider(Failure::from_json(first));
    bool all_ok = true;
    for (int k = 0; k < opt_.nnodes; ++k) {
      const json& s = statuses[static_cast<size_t>(k)];
      if (s.is_null()) {
        all_ok = false;
        consider(Failure{k, -1, 1, "lost_node",
                         fmt::format("the launcher of node {} reported nothing on rendezvous round {} (it died, or cannot reach "
                                     "node 0)",
                                     k, r),
                         ""});
        continue;
      }
      if (!s.value("ok", false)) all_ok = false;
      if (s.contains("failure") && s["failure"].is_object()) consider(Failure::from_json(s["failure"]));
    }
    if (stop_signal() != 0) {
      consider(Failure{0, -1, 128 + stop_signal(), "launcher_signal",
                       fmt::format("the launcher of node 0 got signal {}", stop_signal()), ""});
      all_ok = false;
    }
    if (all_ok) {
      v.action = "done";
    } else {
      v.failure = chosen.value_or(Failure{0, -1, 1, "runtime", "a node's ranks stopped", ""});
      v.code = v.failure.code;
      v.reason = no_restart_reason(v.failure.kind);
      if (v.reason.empty() && v.failure.kind == "nonfinite" && nonfinite_restarts_ >= 1) {
        v.reason = "a non-finite loss stopped the run again after a restart (it is restarted at most once)";
      }
      if (v.reason.empty() && r >= opt_.max_restarts) {
        v.reason = fmt::format("--max-restarts {} used up", opt_.max_restarts);
      }
      v.action = v.reason.empty() ? "restart" : "give_up";
      if (v.action == "restart" && v.failure.kind == "nonfinite") ++nonfinite_restarts_;
    }
    store_.set(key(r, "decision"), to_json(v).dump());
    return v;
  }

  // Another node: node 0's verdict; when node 0's store is gone (its launcher died), one of its own.
  Verdict await_verdict(int64_t r, const RoundResult& own) {
    post_status(r, own);
    const auto deadline = after(opt_.join_timeout_s);
    while (Clock::now() < deadline && stop_signal() == 0) {
      const json d = parse(store_.get(key(r, "decision")));
      if (!d.is_null()) return verdict_of(d);
      // A store that does not know round r is a new one: node 0's launcher was restarted.
      if (!store_.lost() && store_.reachable() && !store_.get(key(r, "start")) && !store_.lost()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    Verdict v;
    v.failure = own.failure.value_or(Failure{0, -1, 1, "lost_node",
                                             fmt::format("node 0's launcher left rendezvous round {} undecided", r), ""});
    if (own.launcher_signal != 0) {
      v.failure = Failure{opt_.node_rank, -1, 128 + own.launcher_signal, "launcher_signal", "this launcher got a signal", ""};
    }
    if (stop_signal() != 0 && own.launcher_signal == 0) {
      v.failure = Failure{opt_.node_rank, -1, 128 + stop_signal(), "launcher_signal", "this launcher got a signal", ""};
    }
    v.code = v.failure.code;
    v.reason = no_restart_reason(v.failure.kind);
    if (v.reason.empty() && r >= opt_.max_restarts) v.reason = fmt::format("--max-restarts {} used up", opt_.max_restarts);
    if (v.reason.empty() && Clock::now() >= deadline) {
      v.reason = fmt::format("node 0's launcher gave no verdict within --join-timeout-s {:g}", opt_.join_timeout_s);
    }
    v.action = v.reason.empty() ? "restart" : "give_up";
    return v;
  }

  // The end of the job: every node acknowledges the verdict; node 0 keeps the store up until all did.
  void finish(int64_t r) {
    store_.set(key(r, fmt::format("ack/{}", opt_.node_rank)), "1");
    if (!host_) return;
    const auto deadline = after(kAckWaitS);
    while (Clock::now() < deadline) {
      bool all = true;
      for (int k = 0; k < opt_.nnodes && all; ++k) all = store_.get(key(r, fmt::format("ack/{}", k))).has_value();
      if (all) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  const LaunchOptions& opt_;
  const bool host_;
  const std::string addr_;
  const int port_;
  LaunchStore store_;
  const bool given_resume_;
  Watcher watcher_;
  std::string nonce_, errors_dir_;
  std::optional<int64_t> checkpoint_step_;
  bool resume_ = false;
  int nonfinite_restarts_ = 0;
  int end_code_ = 1;
};

}  // namespace

int launch_elastic(const LaunchOptions& opt) { return ElasticLaunch(opt).run(); }

}  // namespace dcp
