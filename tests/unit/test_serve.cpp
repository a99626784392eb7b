// dcp serve in-process on an ephemeral 127.0.0.1 port, driven by a real HTTP client (cpp-httplib): completions
// whole and streamed equal generate() with the same seed, policy and budget; 16 concurrent clients each equal to
// its sequential run; admission queues and then refuses; a client that leaves frees its cache; every bad input is
// a 400 naming its field; a shutdown lets in-flight requests finish, then cancels; 2,000 mixed requests leave no
// KV bytes and no resident-memory growth behind. Every wait is bounded.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <httplib.h>

#include <torch/torch.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "dcp/config.h"
#include "dcp/infer.h"
#include "dcp/kv_policies.h"
#include "dcp/serve.h"
#include "infer/serve/api.h"
#include "infer/serve/client.h"
#include "infer/serve/scheduler.h"
#include "tools/serve_bench.h"
#include "unit/kv_test_model.h"
#include "util/thread_priority.h"

using namespace dcp;
using nlohmann::json;
using serve::ClientReply;

namespace {

constexpr uint64_t kModelSeed = 17;
constexpr int64_t kContext = 512;

Transformer tiny_model() { return dcp::test::sharp_model(kModelSeed, Precision::kFp32, 2); }

Config tiny_config() {
  Config c;
  c.model = dcp::test::kv_tiny_config(2);
  c.data.max_seq_len = kContext;
  c.kv.chunk_tokens = 16;
  c.serve.port = 0;
  c.serve.threads = 1;
  c.serve.http_threads = 48;
  c.serve.shutdown_grace_s = 5;
  c.serve.max_tokens = 400;
  return c;
}

// A server running in its own thread; shut down (gracefully) and joined at the end of the scope.
struct Running {
  std::unique_ptr<Server> server;
  std::thread thread;
  int port = 0;
  explicit Running(const Config& cfg, Transformer model = tiny_model()) {
    server = std::make_unique<Server>(std::move(model), cfg, "tiny");
    port = server->bind();
    thread = std::thread([this] { server->run(); });
  }
  ~Running() {
    server->shutdown();
    if (thread.joinable()) thread.join();
  }
  ClientReply complete(const json& body, const std::function<bool(const ClientReply&)>& on_event = {}) const {
    return serve::complete("127.0.0.1", port, body, 30, on_event);
  }
  std::string metrics() const { return serve::get("127.0.0.1", port, "/metrics").second; }
  double metric(const std::string& name, const std::string& labels = "") const {
    return serve::metric(metrics(), name, labels);
  }
  // Waits (at most `timeout_s`) until `pred()` holds.
  template <class P>
  bool wait_for(P pred, double timeout_s = 10) const {
    const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (std::chrono::steady_clock::now() < end) {
      if (pred()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return pred();
  }
};

// generate()'s options for a request's max_tokens, temperature and seed with the server's context and chunks.
GenerateOptions server_options(int64_t max_tokens, double temperature, uint64_t seed) {
  GenerateOptions opt;
  opt.max_new_tokens = max_tokens;
  opt.temperature = temperature;
  opt.seed = seed;
  opt.context = kContext;
  opt.chunk_tokens = 16;
  return opt;
}

// generate() with the request's seed, sampling, policy and budget on the same weights: what `dcp generate` prints.
std::string reference(const std::string& prompt, int64_t max_tokens, double temperature, uint64_t seed,
                      const std::string& policy = "full", double budget = 1, int64_t top_k = 0, double top_p = 1,
                      int64_t chunk_pairs = 0) {
  Transformer model = tiny_model();
  GenerateOptions opt = server_options(max_tokens, temperature, seed);
  opt.top_k = top_k;
  opt.top_p = top_p;
  opt.chunk_pairs = chunk_pairs;
  opt.kv_policy = make_kv_policy_with_budget(policy, budget);
  return generate(model, prompt, opt);
}

std::string bytes_of(const json& reply) {
  std::string out;
  for (const auto& b : reply["choices"][0]["bytes"]) out.push_back(static_cast<char>(b.get<int>()));
  return out;
}

class ServeTest : public ::testing::Test {
 protected:
  void SetUp() override { at::set_num_threads(1); }  // the reference decodes on one thread, as the server does
};

}  // namespace

namespace {

// Wraps a layer-by-layer policy and records the cache's bytes at each moment a step's peak can fall on: a layer
// has appended its tokens, and is about to be compressed (or, when not due, left as it is).
class PeakRecorder : public KvPolicy {
 public:
  explicit PeakRecorder(std::shared_ptr<KvPolicy> inner) : inner_(std::move(inner)) {}
  void after_step(KvCache& cache, const KvStep& step) override { inner_->after_step(cache, step); }
  bool compresses_by_layer() const override { return true; }
  void after_layer(KvCache& cache, int64_t layer, const KvStep& step) override {
    peak = std::max(peak, cache.bytes());
    inner_->after_layer(cache, layer, step);
  }
  KvObservationNeeds needs() const override { return inner_->needs(); }
  int64_t protected_entries() const override { return inner_->protected_entries(); }
  std::optional<KvBudget> budget() const override { return inner_->budget(); }
  int64_t peak = 0;

 private:
  std::shared_ptr<KvPolicy> inner_;
};

}  // namespace

// Hand-computed: a 1025-token prompt in chunks of 512 at 0.25 over 4 layers. Layer by layer the second chunk's
// peak is 3 layers at keep(1024) = 256 plus one at 128 + 512 (1408); all layers at once it is 4 x (128 + 512).
TEST(KvReservation, PeakEntriesFollowTheSchedule) {
  serve::KvGrowth g;
  g.budget = KvBudget{};
  g.budget->ratio = 0.25;
  g.budget->interval = 64;
  g.protect = 68;
  EXPECT_EQ(serve::kv_peak_entries(1025, 128, 512, 0, 4, g), 1408);
  g.by_layer = false;
  EXPECT_EQ(serve::kv_peak_entries(1025, 128, 512, 0, 4, g), 2560);
  // Decoding past the budget over 2 layers: a 10-token prompt kept whole (under protect), then 200 tokens,
  // compressed every 64 to max(ceil(0.25 s), 68) = 68: the peak is as the first layer appends the 192nd token, over
  // 131 entries in each layer (68 + 63): 132 + 131.
  g.by_layer = true;
  EXPECT_EQ(serve::kv_peak_entries(10, 201, 512, 0, 2, g), 263);
  serve::KvGrowth full;
  EXPECT_EQ(serve::kv_peak_entries(1025, 128, 512, 0, 4, full), 4 * (1025 + 128));
  EXPECT_EQ(serve::kv_peak_entries(1025, 128, 512, 262144, 4, full), 4 * (1025 + 128));
  // Chunks bounded by 262144 query-key pairs: 512, 316, 197 (prefill_chunk_length). The last chunk's peak is 3
  // layers at keep(1025) = 257 plus one at keep(828) = 207 + 197: 1175, below the 1408 of two 512-token chunks.
  EXPECT_EQ(serve::kv_peak_entries(1025, 1, 512, 262144, 4, g), 1175);
}

// The reservation is an upper bound of what a session's cache really holds, at every moment, for the policies and
// budgets a request may ask for, short and long prompts, few and many decoded tokens.
TEST(KvReservation, NoSessionHoldsMoreThanItsReservation) {
  at::set_num_threads(1);
  Transformer model = dcp::test::sharp_model(3, Precision::kFp32, 3);
  const int64_t chunk = 16;
  const std::vector<std::pair<std::string, KvPolicyOptions>> policies{
      {"window", {}}, {"snapkv", {}}, {"minimax", {}}, {"minimax", {{"recent_tokens", 40}}},
      {"minimax", {{"recent_tokens", 150}}}, {"minimax", {{"recent_fraction", 1}, {"n_sink", 8}}}, {"h2o", {}},
      // Every scorer's KvPolicy::protected_entries(), large sinks included, on fewer cases each.
      {"window", {{"n_sink", 40}}}, {"tova", {}}, {"expected-attention", {{"n_sink", 30}}}, {"keydiff", {}},
      {"adakv-expected-attention", {{"n_sink", 30}}},
      // Another decoding interval, which the reservation must follow (minimax's budget() carries it too:
      // KvPolicies.BudgetIsWhatTheFactoryBuilt; compressing every 8 tokens here would cost it a minute).
      {"window", {{"interval", 8}}}};
  for (size_t i = 0; i < policies.size(); ++i) {
    const auto& [name, options] = policies[i];
    const bool few = i >= 7;
    const std::vector<double> budgets = few ? std::vector<double>{0.25, 20.0} : std::vector<double>{0.25, 0.5, 0.9, 20.0};
    const std::vector<int64_t> prompts = few ? std::vector<int64_t>{1, 17, 230} : std::vector<int64_t>{1, 15, 16, 17, 100, 230};
    for (double budget : budgets) {
      for (int64_t prompt : prompts) {
        for (int64_t max_tokens : {1, 70}) {
         for (int64_t pairs : {0, 200}) {  // tokens only; chunks of 14 at first, single tokens from 100 on
          SCOPED_TRACE(fmt::format("{}@{} ({} options) prompt {} max_tokens {} chunk_pairs {}", name, budget,
                                   options.size(), prompt, max_tokens, pairs));
          auto recorder = std::make_shared<PeakRecorder>(make_kv_policy_with_budget(name, budget, options));
          DecodeSession session(model, chunk, recorder, pairs);
          const std::vector<int64_t> tokens = dcp::test::random_tokens(prompt + max_tokens, 5 + prompt);
          session.prefill(std::vector<int64_t>(tokens.begin(), tokens.begin() + prompt));
          for (int64_t i = 0; i + 1 < max_tokens; ++i) session.decode(tokens[static_cast<size_t>(prompt + i)]);
          // The scheduler's own reading of the policy (serve::kv_growth), checked against the request's budget.
          const serve::KvGrowth g = serve::kv_growth(*recorder);
          ASSERT_TRUE(g.budget.has_value());
          EXPECT_EQ(g.budget->ratio, budget <= 1 ? budget : 1);
          EXPECT_EQ(g.budget->max_tokens, budget <= 1 ? 0 : static_cast<int64_t>(budget));
          EXPECT_EQ(g.budget->interval, options.count("interval") != 0 ? static_cast<int64_t>(options.at("interval"))
                                                                : kKvDefaultInterval);
          const int64_t reserved = serve::kv_peak_entries(prompt, max_tokens, chunk, pairs, 3, g) * 4 *
                                   session.cache().entry_bytes();
          EXPECT_LE(recorder->peak, reserved);
          EXPECT_LE(session.cache().bytes(), reserved);
         }
        }
      }
    }
  }
}

TEST_F(ServeTest, CompletionEqualsGenerateWithTheSameSeedPolicyAndBudget) {
  Running s(tiny_config());
  struct Case {
    std::string prompt;
    int64_t max_tokens;
    double temperature;
    uint64_t seed;
    std::string policy;
    double budget;
    int64_t top_k;
    double top_p;
  };
  const std::vector<Case> cases{{"Hello", 40, 0.0, 0, "full", 1, 0, 1},
                                {"The quick brown fox jumps over the lazy dog", 60, 0.9, 11, "full", 1, 50, 0.9},
                                {std::string(70, 'x') + "abc", 50, 1.0, 5, "window", 0.5, 0, 1},
                                {"", 20, 0.7, 3, "h2o", 0.5, 0, 0.95}};
  for (const Case& c : cases) {
    json body = {{"prompt", c.prompt}, {"max_tokens", c.max_tokens}, {"temperature", c.temperature},
                 {"seed", c.seed},     {"return_bytes", true},       {"kv_policy", c.policy}};
    if (c.policy != "full") body["kv_budget"] = c.budget;
    if (c.top_k > 0) body["top_k"] = c.top_k;
    if (c.top_p < 1) body["top_p"] = c.top_p;
    const ClientReply r = s.complete(body);
    ASSERT_EQ(r.status, 200) << r.body;
    const std::string expected = reference(c.prompt, c.max_tokens, c.temperature, c.seed, c.policy, c.budget, c.top_k, c.top_p);
    EXPECT_EQ(bytes_of(r.json), expected) << c.prompt << " " << c.policy;
    const json& choice = r.json["choices"][0];
    EXPECT_EQ(choice["text"], serve::sanitize_utf8(expected));
    EXPECT_EQ(choice["finish_reason"], "length");
    EXPECT_EQ(choice["index"], 0);
    EXPECT_EQ(r.json["object"], "text_completion");
    EXPECT_EQ(r.json["model"], "tiny");
    EXPECT_EQ(r.json["usage"]["prompt_tokens"], c.prompt.size());
    EXPECT_EQ(r.json["usage"]["completion_tokens"], c.max_tokens);
    EXPECT_EQ(r.json["usage"]["total_tokens"], static_cast<int64_t>(c.prompt.size()) + c.max_tokens);
    EXPECT_EQ(r.json["kv_cache"]["policy"], c.policy);
    EXPECT_GT(r.json["kv_cache"]["bytes"].get<int64_t>(), 0);
    EXPECT_EQ(r.json["kv_cache"]["abstained"], false);
    EXPECT_EQ(r.json["seed"], c.seed);
  }
  // The cache of a compressed session holds fewer bytes than a full one of the same length.
  const json full = s.complete({{"prompt", std::string(200, 'a')}, {"max_tokens", 8}, {"temperature", 0}}).json;
  const json window = s.complete({{"prompt", std::string(200, 'a')}, {"max_tokens", 8}, {"temperature", 0},
                                  {"kv_policy", "window"}, {"kv_budget", 0.25}}).json;
  EXPECT_LT(window["kv_cache"]["bytes"].get<int64_t>() * 2, full["kv_cache"]["bytes"].get<int64_t>());
  EXPECT_LT(window["kv_cache"]["reserved_bytes"].get<int64_t>(), full["kv_cache"]["reserved_bytes"].get<int64_t>());
}

// kv.chunk_pairs = 200 makes the server's prefill chunks 14, 5, 3, ... then single tokens (prefill_chunk_length):
// dcp generate with the same bound writes the same bytes, compressed or not, alone or beside another session.
TEST_F(ServeTest, CompletionEqualsGenerateWithChunksBoundedByAttentionPairs) {
  Config cfg = tiny_config();
  cfg.kv.chunk_pairs = 200;
  Running s(cfg);
  const std::string prompt = std::string(70, 'x') + "abc" + std::string(40, 'y');
  std::vector<ClientReply> replies(2);
  std::vector<std::thread> clients;
  for (int i = 0; i < 2; ++i) {
    clients.emplace_back([&, i] {
      json body = {{"prompt", prompt}, {"max_tokens", 30}, {"temperature", 0.8}, {"seed", 7 + i}, {"return_bytes", true}};
      if (i == 1) body.update({{"kv_policy", "window"}, {"kv_budget", 0.5}});
      replies[i] = s.complete(body);
    });
  }
  for (auto& t : clients) t.join();
  ASSERT_EQ(replies[0].status, 200) << replies[0].body;
  ASSERT_EQ(replies[1].status, 200) << replies[1].body;
  EXPECT_EQ(bytes_of(replies[0].json), reference(prompt, 30, 0.8, 7, "full", 1, 0, 1, 200));
  EXPECT_EQ(bytes_of(replies[1].json), reference(prompt, 30, 0.8, 8, "window", 0.5, 0, 1, 200));
  // The server really ran the bounded chunks: one prefill chunk per step (serve.prefill_chunks 1), so at least
  // two prompts' worth of them, more than the 2 x 8 steps of unbounded 16-token chunks.
  int64_t chunks = 0;
  for (int64_t seen = 0, n = 1 + static_cast<int64_t>(prompt.size()); seen < n; ++chunks) {
    seen += prefill_chunk_length(seen, n - seen, 16, 200);
  }
  EXPECT_GT(chunks, 8);
  EXPECT_GE(s.metric("dcp_scheduler_steps_total"), 2 * chunks);
  // Every prompt token (BOS included) of both requests ran in some chunk, once; the busy seconds were counted.
  EXPECT_EQ(s.metric("dcp_prefill_tokens_total"), 2.0 * (1 + static_cast<double>(prompt.size())));
  EXPECT_GT(s.metric("dcp_scheduler_step_seconds_total"), 0.0);
  EXPECT_GE(s.metric("dcp_scheduler_step_seconds_total"), s.metric("dcp_decode_step_seconds_total"));
}

// dcp bench-serve refuses a policy spec the server would answer with 400 before any run starts (it used to run the
// whole benchmark and report rows of nothing): an unknown name, a budget outside (0, 1] that is no whole number >= 2.
TEST(ServeBench, APolicySpecTheServerWouldRefuseIsAConfigErrorBeforeAnyRun) {
  Config cfg = tiny_config();
  cfg.data.path = "/nonexistent/corpus";  // reached only if a run started: the error must come first
  for (const std::string& spec : {"bogus@0.3", "window@1.5", "window@0", "window@x", "minimax@-1"}) {
    ServeBenchOptions o;
    o.policies = {spec};
    try {
      run_serve_bench(tiny_model(), cfg, "/nonexistent/checkpoint", o);
      ADD_FAILURE() << spec << " was accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(spec), std::string::npos) << e.what();
    }
  }
}

// A flexformer checkpoint has no cache policy but full: bench-serve refuses another one for its memory runs before
// any run, and does not look at the policies when there are no memory runs.
TEST(ServeBench, AFlexformerCheckpointsMemoryRunsTakePolicyFullAlone) {
  Config cfg = tiny_config();
  cfg.data.path = "/nonexistent/corpus";  // reached only if a run started
  cfg.attention.backend = "flexformer";
  cfg.attention.num_features = 8;
  Transformer model(cfg.model, cfg.attention, Precision::kFp32);
  ServeBenchOptions o;
  o.policies = {"full", "window@0.25"};
  try {
    run_serve_bench(model, cfg, "/nonexistent/checkpoint", o);
    ADD_FAILURE() << "window@0.25 was accepted for a flexformer checkpoint";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("--policies full"), std::string::npos) << e.what();
  }
  // Without memory runs the policies are not used: the run goes on to the prompts, whose corpus does not exist.
  o.memory_requests = 0;
  try {
    run_serve_bench(model, cfg, "/nonexistent/checkpoint", o);
    ADD_FAILURE() << "no error from a corpus that does not exist";
  } catch (const std::exception& e) {
    EXPECT_EQ(std::string(e.what()).find("--policies"), std::string::npos) << e.what();
  }
}

namespace {
// Threads of this process under SCHED_IDLE, and at nice 19 (a thread that exits while it is read counts as neither).
struct Lowered {
  int64_t idle = 0, nice19 = 0, all = 0;
};
Lowered lowered_threads() {
  Lowered n;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    const auto tid = static_cast<pid_t>(std::stol(e.path().filename().string()));
    ++n.all;
    if (sched_getscheduler(tid) == SCHED_IDLE) ++n.idle;
    errno = 0;
    if (getpriority(PRIO_PROCESS, static_cast<id_t>(tid)) == 19 && errno == 0) ++n.nice19;
  }
  return n;
}

// One streamed request; the lowered threads counted while its handler streams.
Lowered lowered_while_streaming(const Config& cfg) {
  Lowered during{-1, -1, -1};
  ClientReply r;
  {
    Running s(cfg);
    r = s.complete({{"prompt", "abc"}, {"max_tokens", 8}, {"stream", true}}, [&](const ClientReply&) {
      if (during.all < 0) during = lowered_threads();
      return true;
    });
  }
  EXPECT_EQ(r.status, 200);
  EXPECT_TRUE(r.done);
  return during;
}
}  // namespace

// serve.http_priority lowers a connection's thread before it serves: low to nice 19, idle to SCHED_IDLE; normal
// (the default) leaves every thread of the server as it was. The scheduler's thread and this test's stay at
// normal priority, so never every thread is lowered.
TEST(Serve, HttpPriorityLowersTheConnectionsThreads) {
  // A test run already lowered (nice -n 19 ctest, chrt -i) could not tell the server's lowering from its own.
  if (getpriority(PRIO_PROCESS, 0) == 19 || sched_getscheduler(0) == SCHED_IDLE) {
    GTEST_SKIP() << "this test process itself runs at nice 19 or under SCHED_IDLE";
  }
  const Lowered before = lowered_threads();  // none unless an earlier test of this process left one
  Config cfg = tiny_config();
  ASSERT_EQ(cfg.serve.http_priority, "normal");  // the default
  cfg.serve.http_priority = "low";
  const Lowered low = lowered_while_streaming(cfg);
  EXPECT_GE(low.nice19, before.nice19 + 1);
  EXPECT_EQ(low.idle, before.idle);
  EXPECT_LT(low.nice19, low.all);
  cfg.serve.http_priority = "idle";
  const Lowered idle = lowered_while_streaming(cfg);
  EXPECT_GE(idle.idle, before.idle + 1);
  EXPECT_LT(idle.idle, idle.all);
  cfg.serve.http_priority = "normal";
  const Lowered normal = lowered_while_streaming(cfg);
  EXPECT_EQ(normal.idle, before.idle);
  EXPECT_EQ(normal.nice19, before.nice19);
}

// serve::complete against a server that splits an event across two writes and then breaks the stream off (no
// [DONE]): with and without on_event (the events then parsed after the stream) the same two events, the text of
// both, each timed at the bytes that completed it, and done false.
TEST(ServeClient, EventsSplitAcrossReadsAndABrokenOffStreamAreParsedEitherWay) {
  httplib::Server fake;
  fake.Post("/v1/completions", [](const httplib::Request&, httplib::Response& res) {
    auto step = std::make_shared<int>(0);
    res.set_chunked_content_provider("text/event-stream", [step](size_t, httplib::DataSink& sink) {
      const std::vector<std::string> writes{"data: {\"choices\":[{\"te", "xt\":\"ab\"}]}\n\n",
                                            "data: {\"choices\":[{\"text\":\"c\"}]}\n\n"};
      if (*step >= static_cast<int>(writes.size())) return false;  // broken off: no [DONE], no terminating chunk
      if (*step > 0) std::this_thread::sleep_for(std::chrono::milliseconds(40));
      const std::string& w = writes[static_cast<size_t>((*step)++)];
      return sink.write(w.data(), w.size());
    });
  });
  const int port = fake.bind_to_any_port("127.0.0.1");
  ASSERT_GT(port, 0);
  std::thread listening([&] { fake.listen_after_bind(); });
  for (const bool with_callback : {false, true}) {
    int called = 0;
    const ClientReply r = serve::complete("127.0.0.1", port, {{"prompt", "x"}, {"stream", true}}, 10,
                                          with_callback ? std::function<bool(const ClientReply&)>([&](const ClientReply&) {
                                            ++called;
                                            return true;
                                          })
                                                        : std::function<bool(const ClientReply&)>());
    EXPECT_FALSE(r.done) << with_callback;
    ASSERT_EQ(r.events.size(), 2u) << with_callback << ": " << r.body;
    EXPECT_EQ(r.text, "abc") << with_callback;
    ASSERT_EQ(r.event_s.size(), 2u);
    // The first event was completed by the second write, 40 ms after the first; the second 40 ms later still.
    EXPECT_GE(r.event_s[1] - r.event_s[0], 0.02) << with_callback;
    EXPECT_EQ(called, with_callback ? 2 : 0);
  }
  fake.stop();
  listening.join();
}

// ThreadPriority: the names round-trip, a bad one is refused naming the key and the value; lowering one thread to
// low sets its nice value to 19 and leaves the calling process's other threads as they were; normal does nothing.
TEST(ThreadPriority, NamesRoundTripAndLowLowersOnlyTheCallingThread) {
  for (ThreadPriority p : {ThreadPriority::normal, ThreadPriority::low, ThreadPriority::idle}) {
    EXPECT_EQ(parse_thread_priority(thread_priority_name(p), "k"), p);
  }
  try {
    parse_thread_priority("high", "serve.http_priority");
    ADD_FAILURE() << "high was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("serve.http_priority: 'high'"), std::string::npos) << e.what();
  }
  const int before = getpriority(PRIO_PROCESS, static_cast<id_t>(gettid()));
  if (before == 19) GTEST_SKIP() << "this test process already runs at nice 19";
  EXPECT_EQ(lower_this_thread(ThreadPriority::normal), "");
  EXPECT_EQ(getpriority(PRIO_PROCESS, static_cast<id_t>(gettid())), before);
  int lowered = 0;
  std::string why;
  std::thread t([&] {
    why = lower_this_thread(ThreadPriority::low);
    lowered = getpriority(PRIO_PROCESS, static_cast<id_t>(gettid()));
  });
  t.join();
  EXPECT_EQ(why, "");
  EXPECT_EQ(lowered, 19);
  EXPECT_EQ(getpriority(PRIO_PROCESS, static_cast<id_t>(gettid())), before);
}

// PrefillBudget on made-up step times: off, or before both costs are measured, it sets no limit; then
// (ratio - 1) decode_s / token_s tokens, never fewer than kMinTokens (a shorter prompt's chunk is its own length:
// the scheduler takes the smaller); a step measured faster
// than a decode step keeps the token cost positive; a bad ratio is refused naming the key.
TEST(PrefillBudget, AllowsTheTokensThatFitRatioMinusOneDecodeSteps) {
  serve::PrefillBudget off(0);
  off.decode_step(0.002, 16);
  off.prefill_step(0.004, 100);
  EXPECT_EQ(off.tokens(), std::nullopt);
  EXPECT_EQ(off.decode_seconds(), 0);

  serve::PrefillBudget b(1.5);
  EXPECT_EQ(b.tokens(), std::nullopt);  // nothing measured: no limit
  b.prefill_step(0.004, 100);     // before any decode step: not a measurement
  EXPECT_EQ(b.token_seconds(), 0);
  b.decode_step(0.002, 16);
  EXPECT_EQ(b.tokens(), std::nullopt);  // no prefill cost yet
  b.prefill_step(0.004, 100);     // 2 ms beyond a decode step over 100 tokens: 20 us a token
  EXPECT_NEAR(b.token_seconds(), 2e-5, 1e-12);
  EXPECT_EQ(b.tokens(), 50);      // 0.5 x 2 ms / 20 us
  // Moving averages (weight 0.25 on the new step): decode 2 ms -> 2.5 ms after a 4 ms step.
  b.decode_step(0.004, 16);
  EXPECT_NEAR(b.decode_seconds(), 0.0025, 1e-12);
  EXPECT_EQ(b.tokens(), 62);      // 0.5 x 2.5 ms / 20 us = 62.5
  // A step faster than the decode average: 1% of a decode step over its tokens, not a negative cost.
  serve::PrefillBudget fast(1.5);
  fast.decode_step(0.002, 16);
  fast.prefill_step(0.001, 10);
  EXPECT_NEAR(fast.token_seconds(), 2e-6, 1e-15);
  EXPECT_EQ(fast.tokens(), 500);
  // Infinite or negative seconds are not measurements; a decode step measured at 0 s is one (a coarse clock), and
  // the token cost stays positive after it.
  serve::PrefillBudget zero(1.5);
  zero.decode_step(std::numeric_limits<double>::infinity(), 4);
  zero.decode_step(-1, 4);
  EXPECT_TRUE(zero.measure_decode(4));
  zero.decode_step(0, 4);
  EXPECT_FALSE(zero.measure_decode(4));
  zero.prefill_step(std::numeric_limits<double>::infinity(), 10);
  EXPECT_EQ(zero.tokens(), std::nullopt);  // no prefill cost measured yet
  zero.prefill_step(0, 10);
  EXPECT_GT(zero.token_seconds(), 0);
  EXPECT_EQ(zero.tokens(), serve::PrefillBudget::kMinTokens);  // 0.5 x 0 s of room
  // A ratio of 1 leaves no time: the floor.
  serve::PrefillBudget none(1.0);
  none.decode_step(0.002, 16);
  none.prefill_step(0.004, 100);
  EXPECT_EQ(none.tokens(), serve::PrefillBudget::kMinTokens);
  // Decode-only measurements: asked for before the first, after kRefreshSteps steps with a chunk, and when the
  // decoding sessions moved by more than a quarter (then the new step replaces the average); never when off.
  EXPECT_FALSE(off.measure_decode(16));
  serve::PrefillBudget m(1.5);
  EXPECT_TRUE(m.measure_decode(16));
  EXPECT_FALSE(m.measure_decode(0));
  m.decode_step(0.002, 16);
  EXPECT_FALSE(m.measure_decode(16));
  EXPECT_FALSE(m.measure_decode(20));
  EXPECT_FALSE(m.measure_decode(12));
  EXPECT_TRUE(m.measure_decode(21));
  EXPECT_TRUE(m.measure_decode(11));
  for (int64_t i = 0; i < serve::PrefillBudget::kRefreshSteps - 1; ++i) m.prefill_step(0.003, 20);
  EXPECT_FALSE(m.measure_decode(16));
  m.prefill_step(0.003, 20);
  EXPECT_TRUE(m.measure_decode(16));
  m.decode_step(0.004, 24);  // 24 > 1.25 x 16: replaced, not averaged
  EXPECT_NEAR(m.decode_seconds(), 0.004, 1e-15);
  EXPECT_FALSE(m.measure_decode(24));
  for (double bad : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    try {
      serve::PrefillBudget refused(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("serve.prefill_step_ratio"), std::string::npos) << e.what();
    }
    try {
      serve::PrefillBudget refused(1.5, bad);
      ADD_FAILURE() << "a floor of " << bad << " s was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("serve.prefill_step_ms"), std::string::npos) << e.what();
    }
  }
}

// The step floor (serve.prefill_step_ms): a step may take max(ratio x decode_s, floor); the floor alone turns the
// budget on, and a decode step longer than the floor leaves the 16-token minimum.
TEST(PrefillBudget, AStepFloorLengthensTheChunksOfShortDecodeSteps) {
  serve::PrefillBudget b(1.5, 0.010);  // 10 ms
  b.decode_step(0.002, 1);
  b.prefill_step(0.004, 100);  // 20 us a token
  EXPECT_EQ(b.tokens(), 400);  // (10 ms - 2 ms) / 20 us; ratio 1.5 alone would allow 50
  b.decode_step(0.008, 8);     // 8 > 1.25 x 1: replaced
  b.prefill_step(0.010, 100);  // (10 - 8) ms / 100 = 20 us: the average stays
  EXPECT_EQ(b.tokens(), 200);  // max(12 ms, 10 ms) - 8 ms = 4 ms
  serve::PrefillBudget floor_only(0, 0.010);
  EXPECT_TRUE(floor_only.measure_decode(1));
  floor_only.decode_step(0.002, 1);
  floor_only.prefill_step(0.004, 100);
  EXPECT_EQ(floor_only.tokens(), 400);
  floor_only.decode_step(0.012, 8);  // a decode step past the floor: nothing left but the minimum
  EXPECT_EQ(floor_only.tokens(), serve::PrefillBudget::kMinTokens);
  serve::PrefillBudget off(0, 0);
  EXPECT_FALSE(off.measure_decode(1));
  off.decode_step(0.002, 1);
  off.prefill_step(0.004, 100);
  EXPECT_EQ(off.tokens(), std::nullopt);
  // The rule bench-serve's report states too: either key > 0 turns the budget on.
  EXPECT_TRUE(serve::PrefillBudget::enabled(1.5, 0));
  EXPECT_TRUE(serve::PrefillBudget::enabled(0, 0.040));
  EXPECT_FALSE(serve::PrefillBudget::enabled(0, 0));
}

// The budget on a running server: while one session decodes, two 300-byte prompts (chunks of 64) sent together are
// cut to shorter chunks with ratio 1.01 (one percent of a decode step leaves the 16-token minimum), or with a step
// floor of 1 us and ratio 0; when the first of them starts decoding the decoding sessions double, and the budget
// runs a decode-only step to measure them while the second prompt waits. Every request answers in full. With both
// keys 0, or for a compressing policy (window), no chunk is cut and no such step runs.
TEST_F(ServeTest, PrefillChunksBesideDecodingAreShortenedToTheStepBudget) {
  struct Case {
    double ratio;
    double floor_ms;  // serve.prefill_step_ms
    std::string policy;
    bool budgeted;
  };
  // The floor alone turns the budget on through the server's config: 1 us is shorter than any decode step, so its
  // chunks are the 16-token minimum, as with ratio 1.01.
  for (const Case& c : {Case{1.01, 0, "full", true}, Case{0, 0.001, "full", true}, Case{0, 0, "full", false},
                        Case{1.01, 0, "window", false}}) {
    SCOPED_TRACE(fmt::format("ratio {} floor {} ms policy {}", c.ratio, c.floor_ms, c.policy));
    Config cfg = tiny_config();
    cfg.kv.chunk_tokens = 64;
    cfg.serve.prefill_step_ratio = c.ratio;
    cfg.serve.prefill_step_ms = c.floor_ms;
    Running s(cfg);
    const auto shortened = [&] { return s.metric("dcp_prefill_chunks_shortened_total"); };
    const auto measured = [&] { return s.metric("dcp_prefill_budget_decode_steps_total"); };
    // The decoding session may end before the prompts arrive on a loaded machine: a few tries.
    for (int attempt = 0; attempt < 5; ++attempt) {
      std::atomic<bool> decoding{false};
      ClientReply first;
      std::thread long_one([&] {
        first = s.complete({{"prompt", "a"}, {"max_tokens", 400}, {"temperature", 0.0}, {"stream", true}},
                           [&](const ClientReply&) {
                             decoding = true;
                             return true;
                           });
      });
      ASSERT_TRUE(s.wait_for([&] { return decoding.load(); })) << s.metrics();
      json body = {{"prompt", std::string(300, 'q')}, {"max_tokens", 8}, {"temperature", 0.0}};
      if (c.policy != "full") {
        body["kv_policy"] = c.policy;
        body["kv_budget"] = 0.5;
      }
      ClientReply second, third;
      std::thread other([&] { third = s.complete(body); });
      second = s.complete(body);
      other.join();
      long_one.join();
      ASSERT_TRUE(first.done && !first.last.is_null()) << first.body.substr(0, 400);
      EXPECT_EQ(first.last["usage"]["completion_tokens"], 400);
      for (const ClientReply* r : {&second, &third}) {
        ASSERT_EQ(r->status, 200) << r->body;
        EXPECT_EQ(r->json["usage"]["completion_tokens"], 8);
      }
      if (!c.budgeted || (shortened() > 0 && measured() > 0)) break;
    }
    const double chunks = shortened();
    const double tokens = s.metric("dcp_prefill_shortened_tokens_total");
    if (c.budgeted) {
      EXPECT_GT(chunks, 0) << s.metrics();
      EXPECT_GE(tokens, chunks * serve::PrefillBudget::kMinTokens);
      EXPECT_LT(tokens, chunks * 64);
      EXPECT_GT(measured(), 0) << s.metrics();
    } else {
      EXPECT_EQ(chunks, 0) << c.ratio << " " << c.policy;
      EXPECT_EQ(tokens, 0);
      EXPECT_EQ(measured(), 0) << c.ratio << " " << c.policy;
    }
  }
}

namespace {
ServeBenchRow window_row(const char* run, int64_t bytes, double seconds) {
  ServeBenchRow r;
  r.run = run;
  r.requests = r.answered = 16;
  r.window_bytes = bytes;
  r.window_s = seconds;
  r.window_tokens_per_s = seconds > 0 ? bytes / seconds : -1;
  return r;
}
}  // namespace

// pool_batching on rows made by hand: the pooled ratio is the bytes over the seconds of the usable pairs on each side
// (not the mean or median of the pair ratios), a pair with a missing window or a failed request counts in neither
// side, the median of an odd count is its middle ratio.
TEST(ServeBench, PoolBatchingPoolsBytesOverSecondsOfTheUsablePairs) {
  // Pair 1: 3000 B / 1 s against 1000 B / 1 s (3x). Pair 2: 2000 B / 2 s against 1000 B / 2 s (2x).
  // Pair 3: 4000 B / 1 s against 500 B / 1 s (8x). Pair 4: the sequential run has no window. Pair 5: a failure.
  std::vector<ServeBenchRow> b{window_row("batching", 3000, 1), window_row("batching", 2000, 2),
                               window_row("batching", 4000, 1), window_row("batching", 9000, 1),
                               window_row("batching", 9000, 1)};
  std::vector<ServeBenchRow> q{window_row("batching-sequential", 1000, 1), window_row("batching-sequential", 1000, 2),
                               window_row("batching-sequential", 500, 1), window_row("batching-sequential", -1, -1),
                               window_row("batching-sequential", 100, 1)};
  q[4].answered = 15;
  q[4].failed = 1;
  std::vector<const ServeBenchRow*> pb, pq;
  for (size_t i = 0; i < b.size(); ++i) {
    pb.push_back(&b[i]);
    pq.push_back(&q[i]);
  }
  const BatchingPool pool = pool_batching(pb, pq);
  EXPECT_EQ(pool.pairs, 5);
  EXPECT_EQ(pool.usable, 3);
  EXPECT_EQ(pool.batched_bytes, 9000);
  EXPECT_EQ(pool.sequential_bytes, 2500);
  EXPECT_DOUBLE_EQ(pool.batched_s, 4);
  EXPECT_DOUBLE_EQ(pool.sequential_s, 4);
  EXPECT_DOUBLE_EQ(pool.ratio(), (9000.0 / 4) / (2500.0 / 4));  // 3.6x: neither the mean (4.33x) nor the median
  EXPECT_DOUBLE_EQ(pool.median_ratio, 3);
  ASSERT_EQ(pool.ratios.size(), 5u);
  EXPECT_DOUBLE_EQ(pool.ratios[0], 3);
  EXPECT_DOUBLE_EQ(pool.ratios[1], 2);
  EXPECT_DOUBLE_EQ(pool.ratios[2], 8);
  EXPECT_TRUE(std::isnan(pool.ratios[3]));
  EXPECT_TRUE(std::isnan(pool.ratios[4]));
  // No usable pair: ratio 0, not a division by zero.
  const BatchingPool none = pool_batching({pb[3], pb[4]}, {pq[3], pq[4]});
  EXPECT_EQ(none.usable, 0);
  EXPECT_EQ(none.ratio(), 0);
  EXPECT_EQ(none.median_ratio, 0);
  // Empty and mismatched lists.
  EXPECT_EQ(pool_batching({}, {}).pairs, 0);
  EXPECT_THROW(pool_batching({pb[0]}, {}), std::invalid_argument);
}

// dcp bench-serve's batching runs on the tiny model: N requests sent at once, then the same N one after another;
// each reports the decode rate the clients saw over an interval that holds a whole number of the bytes (every
// request runs to max_tokens: greedy, no stop).
TEST(ServeBench, BatchingRunsReportTheClientsDecodeRateAtNConcurrentSessions) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / fmt::format("dcp_bench_serve_{}", ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  for (int i = 0; i < 24; ++i) {
    std::string text;
    for (int j = 0; text.size() < 400; ++j) text += fmt::format("line {} of document {}: the quick brown fox\n", j, i);
    std::ofstream(dir / fmt::format("doc{}.txt", i)) << text;
  }
  Config cfg = tiny_config();
  cfg.data.path = dir.string();
  cfg.data.format = "text_dir";
  cfg.data.heldout_fraction = 0.5;
  ServeBenchOptions o;
  o.clients = {1};
  o.requests = 1;
  o.min_prompt = 64;
  o.max_prompt = 128;
  o.max_tokens = 8;
  o.memory_requests = 0;
  o.batching_sessions = 3;
  o.batching_tokens = 64;
  o.batching_repeats = 2;
  o.plot = false;
  o.out = (dir / "report").string();
  const std::vector<ServeBenchRow> rows = run_serve_bench(tiny_model(), cfg, "/tmp/tiny/checkpoint", o);
  std::ifstream md_in(o.out + ".md");
  const std::string md((std::istreambuf_iterator<char>(md_in)), std::istreambuf_iterator<char>());
  fs::remove_all(dir);
  // Two pairs, the second in the other order (ABBA): batched, sequential, sequential, batched.
  std::vector<std::pair<std::string, int64_t>> order;
  for (const auto& r : rows) {
    if (r.repeat > 0) order.emplace_back(r.run, r.repeat);
  }
  const std::vector<std::pair<std::string, int64_t>> abba{
      {"batching", 1}, {"batching-sequential", 1}, {"batching-sequential", 2}, {"batching", 2}};
  EXPECT_EQ(order, abba);
  // The report pools the pairs (every pair's bytes over every pair's seconds, each side) and lists each.
  double bytes[2] = {0, 0}, seconds[2] = {0, 0};
  for (const auto& r : rows) {
    if (r.repeat == 0) continue;
    ASSERT_GT(r.window_s, 0) << r.run << " pair " << r.repeat;
    const int side = r.run == "batching" ? 0 : 1;
    ASSERT_GT(r.window_bytes, 0) << r.run << " pair " << r.repeat;
    EXPECT_NEAR(r.window_tokens_per_s, r.window_bytes / r.window_s, 1e-9 * r.window_tokens_per_s);
    bytes[side] += static_cast<double>(r.window_bytes);
    seconds[side] += r.window_s;
  }
  const double pooled = (bytes[0] / seconds[0]) / (bytes[1] / seconds[1]);
  EXPECT_NE(md.find("2 pairs of runs"), std::string::npos) << md;
  EXPECT_NE(md.find("HTTP threads' priority normal (serve.http_priority)"), std::string::npos) << md;
  EXPECT_NE(md.find("serve.prefill_step_ratio and serve.prefill_step_ms 0: never shortened"), std::string::npos) << md;
  EXPECT_NE(md.find("run at the server's priority (`--client-priority normal`)"), std::string::npos) << md;  // the default
  EXPECT_NE(md.find(fmt::format("**{:.2f}x** ({:.1f} tokens/s against {:.1f}; the 2 pair ratios range", pooled,
                                bytes[0] / seconds[0], bytes[1] / seconds[1])),
            std::string::npos)
      << md;
  EXPECT_NE(md.find("| 2 | one after another |"), std::string::npos) << md;
  const ServeBenchRow* batched = nullptr;
  const ServeBenchRow* sequential = nullptr;
  for (const auto& r : rows) {
    if (r.run == "batching" && r.repeat == 1) batched = &r;
    if (r.run == "batching-sequential" && r.repeat == 1) sequential = &r;
  }
  ASSERT_NE(batched, nullptr);
  ASSERT_NE(sequential, nullptr);
  EXPECT_EQ(batched->clients, 3);
  EXPECT_EQ(sequential->clients, 1);
  for (const ServeBenchRow* r : {batched, sequential}) {
    EXPECT_EQ(r->requests, 3);
    EXPECT_EQ(r->answered, 3) << r->first_failure;
    EXPECT_EQ(r->tokens, 3 * 64);
    EXPECT_GT(r->window_s, 0);
    EXPECT_GT(r->window_tokens_per_s, 0);
  }
  // Each rate times its seconds is a whole number of bytes, at most the 63 after each request's first: the
  // sequential run counts those after each first event (a first event may carry several when the client lags), the
  // batched one those that arrived while every session decoded.
  for (const ServeBenchRow* r : {batched, sequential}) {
    const double bytes = r->window_tokens_per_s * r->window_s;
    EXPECT_NEAR(bytes, std::round(bytes), 1e-6) << r->run;
    EXPECT_GE(bytes, 1 - 1e-6) << r->run;
    EXPECT_LE(bytes, 3 * 63 + 1e-6) << r->run;
  }
  for (const auto& r : rows) {
    if (r.run == "throughput" || r.run == "sequential") EXPECT_LT(r.window_s, 0) << r.run;
  }
}

TEST_F(ServeTest, StreamingSendsTheSameBytesAsServerSentEvents) {
  Running s(tiny_config());
  const json body = {{"prompt", "Once upon a time"}, {"max_tokens", 48}, {"temperature", 0.8}, {"seed", 9},
                     {"return_bytes", true}};
  const ClientReply whole = s.complete(body);
  ASSERT_EQ(whole.status, 200);
  json streamed = body;
  streamed["stream"] = true;
  const ClientReply r = s.complete(streamed);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(r.done) << "no data: [DONE]";
  EXPECT_EQ(r.bytes, bytes_of(whole.json));
  EXPECT_EQ(r.text, whole.json["choices"][0]["text"].get<std::string>());
  ASSERT_FALSE(r.last.is_null());
  EXPECT_EQ(r.last["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(r.last["usage"]["completion_tokens"], 48);
  EXPECT_GT(r.last["kv_cache"]["bytes"].get<int64_t>(), 0);
  EXPECT_GT(r.events.size(), 2u);  // streamed as it came, not in one piece
  for (const auto& e : r.events) {
    EXPECT_EQ(e["object"], "text_completion");
    EXPECT_EQ(e["id"], r.events[0]["id"]);
  }
  EXPECT_NE(r.body.find("data: {"), std::string::npos);
  EXPECT_NE(r.body.rfind("data: [DONE]\n\n"), std::string::npos);
  // echo puts the prompt first; include_usage sends usage in its own last chunk with no choices.
  json echo = streamed;
  echo["echo"] = true;
  echo["stream_options"] = {{"include_usage", true}};
  const ClientReply e = s.complete(echo);
  ASSERT_EQ(e.status, 200);
  EXPECT_EQ(e.text, "Once upon a time" + r.text);
  EXPECT_TRUE(e.events.back()["choices"].empty());
  EXPECT_EQ(e.events.back()["usage"]["completion_tokens"], 48);
  const ClientReply ne = s.complete({{"prompt", "ab"}, {"max_tokens", 4}, {"echo", true}, {"temperature", 0}});
  EXPECT_EQ(ne.json["choices"][0]["text"].get<std::string>().rfind("ab", 0), 0u);
}

TEST_F(ServeTest, StopSequencesEndTheCompletionWithoutTheirText) {
  Running s(tiny_config());
  const json base = {{"prompt", "abc"}, {"max_tokens", 60}, {"temperature", 0.9}, {"seed", 4}, {"return_bytes", true}};
  const std::string full = bytes_of(s.complete(base).json);
  // A stop sequence taken from the middle of what the model writes: an ASCII byte (a JSON string is UTF-8,
  // and a random model writes many bytes that are not).
  size_t pick = 10;
  while (pick < full.size() && static_cast<unsigned char>(full[pick]) >= 0x80) ++pick;
  ASSERT_LT(pick, full.size()) << "no ASCII byte after the 10th";
  const std::string stop = full.substr(pick, 1);
  const size_t at = full.find(stop);
  json stopped = base;
  stopped["stop"] = json::array({"\x01\x02 never", stop});
  const ClientReply r = s.complete(stopped);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.json["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(r.json["choices"][0]["text"], serve::sanitize_utf8(full.substr(0, at)));
  stopped["stream"] = true;
  const ClientReply st = s.complete(stopped);
  EXPECT_EQ(st.last["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(st.text, serve::sanitize_utf8(full.substr(0, at)));  // the held-back bytes of the stop never left
}

TEST_F(ServeTest, SeedsReproduceAndDiffer) {
  Running s(tiny_config());
  const json a = {{"prompt", "seed"}, {"max_tokens", 40}, {"temperature", 1.0}, {"seed", 1234}, {"return_bytes", true}};
  json b = a;
  b["seed"] = 1235;
  const std::string first = bytes_of(s.complete(a).json), again = bytes_of(s.complete(a).json),
                    other = bytes_of(s.complete(b).json);
  EXPECT_EQ(first, again);
  EXPECT_NE(first, other);
  // Without a seed the server draws one and says which: asking with it repeats the bytes.
  const json unseeded = s.complete({{"prompt", "seed"}, {"max_tokens", 40}, {"return_bytes", true}}).json;
  json replay = {{"prompt", "seed"}, {"max_tokens", 40}, {"return_bytes", true}, {"seed", unseeded["seed"]}};
  EXPECT_EQ(bytes_of(s.complete(replay).json), bytes_of(unseeded));
}

// 16 clients at once, prompts of 1..90 bytes (several prefill chunks beside other sessions' decode tokens):
// every answer equals generate() run alone, under the batched scheduler and under the sequential one.
TEST_F(ServeTest, SixteenConcurrentClientsEachEqualTheirSequentialRun) {
  for (const std::string scheduler : {"batched", "sequential"}) {
    Config cfg = tiny_config();
    cfg.serve.scheduler = scheduler;
    Running s(cfg);
    const int n = 16;
    std::vector<json> bodies(n);
    std::vector<ClientReply> replies(n);
    for (int i = 0; i < n; ++i) {
      bodies[i] = {{"prompt", std::string(1 + (i * 37) % 90, static_cast<char>('a' + i))},
                   {"max_tokens", 30 + i},
                   {"temperature", i % 4 == 0 ? 0.0 : 0.9},
                   {"seed", 100 + i},
                   {"return_bytes", true},
                   {"stream", i % 2 == 0}};
      if (i % 3 == 0) {
        bodies[i]["kv_policy"] = "window";
        bodies[i]["kv_budget"] = 0.5;
      }
    }
    std::vector<std::thread> clients;
    for (int i = 0; i < n; ++i) clients.emplace_back([&, i] { replies[i] = s.complete(bodies[i]); });
    for (auto& t : clients) t.join();
    for (int i = 0; i < n; ++i) {
      ASSERT_EQ(replies[i].status, 200) << scheduler << " client " << i << ": " << replies[i].body.substr(0, 400)
                                        << " error " << replies[i].error << ", events " << replies[i].events.size()
                                        << "\n" << s.metrics();
      const std::string got = bodies[i]["stream"] ? replies[i].bytes : bytes_of(replies[i].json);
      const std::string expected =
          reference(bodies[i]["prompt"], bodies[i]["max_tokens"], bodies[i]["temperature"], bodies[i]["seed"],
                    i % 3 == 0 ? "window" : "full", i % 3 == 0 ? 0.5 : 1.0);
      EXPECT_EQ(got, expected) << scheduler << " client " << i;
    }
    const std::string m = s.metrics();
    EXPECT_GE(serve::metric(m, "dcp_sessions_active_peak"), 2) << scheduler << ": the sessions never ran together";
    EXPECT_EQ(serve::metric(m, "dcp_requests_total", "status=\"200\""), n);
  }
}

// Memory for exactly two full sessions and a queue of two: the first two run, the next two wait, the fifth is
// refused with 503 and Retry-After; every admitted one finishes, and then nothing is held. A request that could
// never fit is a 400; compression makes one fit.
TEST_F(ServeTest, AdmissionQueuesWhenTheKvBudgetIsFullAndRefusesBeyondTheQueue) {
  Config cfg = tiny_config();
  const int64_t prompt = 99, max_tokens = 300;
  const int64_t entry = 2 * 16 * 4 + 4 + 8;  // keys + values fp32 (head_dim 16) + bias + position
  const int64_t per_session = (1 + prompt + max_tokens) * 2 /*layers*/ * 4 /*heads*/ * entry;
  cfg.serve.kv_memory_bytes = static_cast<double>(2 * per_session);
  cfg.serve.max_queue = 2;
  cfg.serve.retry_after_s = 3;
  Running s(cfg);
  const json body = {{"prompt", std::string(prompt, 'q')}, {"max_tokens", max_tokens}, {"temperature", 0}, {"stream", true}};
  std::vector<ClientReply> replies(4);
  std::vector<std::thread> clients;
  for (int i = 0; i < 2; ++i) clients.emplace_back([&, i] { replies[i] = s.complete(body); });
  ASSERT_TRUE(s.wait_for([&] { return s.metric("dcp_sessions_active") == 2; })) << s.metrics();
  for (int i = 2; i < 4; ++i) clients.emplace_back([&, i] { replies[i] = s.complete(body); });
  ASSERT_TRUE(s.wait_for([&] { return s.metric("dcp_sessions_queued") == 2; })) << s.metrics();
  EXPECT_EQ(s.metric("dcp_sessions_active"), 2);
  EXPECT_EQ(s.metric("dcp_kv_held_bytes"), 2 * per_session);
  const ClientReply refused = s.complete(body);
  EXPECT_EQ(refused.status, 503);
  EXPECT_EQ(refused.retry_after, "3");
  EXPECT_EQ(refused.json["error"]["code"], "queue_full") << refused.body;
  for (auto& t : clients) t.join();
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(replies[i].status, 200);
    EXPECT_EQ(replies[i].last["choices"][0]["finish_reason"], "length") << "request " << i;
  }
  ASSERT_TRUE(s.wait_for([&] { return s.metric("dcp_kv_held_bytes") == 0; }));
  EXPECT_EQ(s.metric("dcp_kv_bytes"), 0);
  EXPECT_EQ(s.metric("dcp_sessions_active_peak"), 2);
  // While requests waited, the budget held exactly its two sessions: the mean over those seconds is 2, and the KV
  // bytes held then averaged at most the two reservations (a full cache grows to its reservation).
  const double saturated = s.metric("dcp_saturated_seconds_total");
  ASSERT_GT(saturated, 0) << s.metrics();
  EXPECT_NEAR(s.metric("dcp_saturated_session_seconds_total") / saturated, 2.0, 1e-9) << s.metrics();
  const double kv_mean = s.metric("dcp_saturated_kv_byte_seconds_total") / saturated;
  EXPECT_GT(kv_mean, 0);
  EXPECT_LE(kv_mean, 2.0 * per_session * (1 + 1e-9));
  // Three full sessions never fit; at budget 0.25 the same request reserves less and is served.
  const json big = {{"prompt", std::string(prompt, 'q')}, {"max_tokens", max_tokens}, {"temperature", 0}};
  Config small = cfg;
  small.serve.kv_memory_bytes = static_cast<double>(per_session / 2);
  Running t(small);
  const ClientReply too_big = t.complete(big);
  EXPECT_EQ(too_big.status, 400);
  EXPECT_EQ(too_big.json["error"]["code"], "kv_memory_exceeded") << too_big.body;
  json compressed = big;
  compressed["kv_policy"] = "window";
  compressed["kv_budget"] = 0.1;
  compressed["max_tokens"] = 40;
  const ClientReply fits = t.complete(compressed);
  EXPECT_EQ(fits.status, 200) << fits.body;
}

TEST_F(ServeTest, AClientThatDisconnectsMidStreamCancelsItsSessionAndFreesTheCache) {
  Config cfg = tiny_config();
  Running s(cfg);
  int seen = 0;
  const ClientReply r = s.complete({{"prompt", "leave early"}, {"max_tokens", 400}, {"stream", true}, {"temperature", 0}},
                                   [&](const ClientReply& so_far) {
                                     seen = static_cast<int>(so_far.events.size());
                                     return so_far.events.size() < 3;  // close the connection after 3 events
                                   });
  EXPECT_EQ(seen, 3);
  EXPECT_FALSE(r.done);
  ASSERT_TRUE(s.wait_for([&] {
    const std::string m = s.metrics();
    return serve::metric(m, "dcp_completions_total", "reason=\"cancelled\"") == 1 &&
           serve::metric(m, "dcp_sessions_active") == 0;
  })) << s.metrics();
  const std::string m = s.metrics();
  EXPECT_EQ(serve::metric(m, "dcp_kv_bytes"), 0);
  EXPECT_EQ(serve::metric(m, "dcp_kv_held_bytes"), 0);
  EXPECT_LT(serve::metric(m, "dcp_completion_tokens_total"), 400);  // stopped early, not run to the end
}

TEST_F(ServeTest, EveryBadInputIsA400NamingTheField) {
  Config cfg = tiny_config();
  cfg.serve.max_prompt_bytes = 100;
  cfg.serve.max_body_bytes = 4096;
  cfg.serve.max_context = 300;
  Running s(cfg);
  auto post = [&](const std::string& raw) {
    httplib::Client c("127.0.0.1", s.port);
    c.set_read_timeout(10);
    auto res = c.Post("/v1/completions", raw, "application/json");
    return std::make_pair(res ? res->status : 0, res ? json::parse(res->body, nullptr, false) : json());
  };
  struct Case {
    std::string body, param, code;
    int status = 400;
  };
  const std::vector<Case> cases{
      {"{", "", "invalid_json"},
      {"[1, 2]", "", "invalid_json"},
      {R"({"prompt": "a", "temperature": NaN})", "", "invalid_json"},
      {"{}", "prompt", "missing_field"},
      {R"({"prompt": 5})", "prompt", "invalid_type"},
      {R"({"prompt": ["a", "b"]})", "prompt", "invalid_type"},
      {R"({"prompt": ")" + std::string(101, 'p') + R"("})", "prompt", "prompt_too_long"},
      {R"({"prompt": "a", "max_tokens": 0})", "max_tokens", "invalid_value"},
      {R"({"prompt": "a", "max_tokens": -3})", "max_tokens", "invalid_value"},
      {R"({"prompt": "a", "max_tokens": 401})", "max_tokens", "invalid_value"},
      {R"({"prompt": "a", "max_tokens": 18446744073709551615})", "max_tokens", "invalid_value"},
      {R"({"prompt": "a", "max_tokens": 2.5})", "max_tokens", "invalid_type"},
      {R"({"prompt": "a", "max_tokens": "5"})", "max_tokens", "invalid_type"},
      {R"({"prompt": "a", "temperature": -0.1})", "temperature", "invalid_value"},
      {R"({"prompt": "a", "temperature": 1e999})", "", "invalid_json"},  // beyond a double: not parsed at all
      {R"({"prompt": "a", "temperature": "hot"})", "temperature", "invalid_type"},
      {R"({"prompt": "a", "top_p": 0})", "top_p", "invalid_value"},
      {R"({"prompt": "a", "top_p": 1.5})", "top_p", "invalid_value"},
      {R"({"prompt": "a", "top_k": 300})", "top_k", "invalid_value"},
      {R"({"prompt": "a", "seed": -1})", "seed", "invalid_value"},
      {R"({"prompt": "a", "seed": 1.5})", "seed", "invalid_type"},
      // A whole number written as a float is of the right type: out of range, not "a number with a fraction".
      {R"({"prompt": "a", "max_tokens": 1e30})", "max_tokens", "invalid_value"},
      {R"({"prompt": "a", "top_k": 1e3})", "top_k", "invalid_value"},
      {R"({"prompt": "a", "seed": 1e30})", "seed", "invalid_value"},
      {R"({"prompt": "a", "stop": 5})", "stop", "invalid_type"},
      {R"({"prompt": "a", "stop": [""]})", "stop", "invalid_value"},
      {R"({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]})", "stop", "invalid_value"},
      {R"({"prompt": "a", "stream": "yes"})", "stream", "invalid_type"},
      {R"({"prompt": "a", "stream_options": {"include_usage": true}})", "stream_options", "invalid_value"},
      {R"({"prompt": "a", "echo": 1})", "echo", "invalid_type"},
      {R"({"prompt": "a", "n": 2})", "n", "unsupported"},
      {R"({"prompt": "a", "logprobs": 1})", "logprobs", "unsupported"},
      {R"({"prompt": "a", "frequency_penalty": 0.5})", "frequency_penalty", "unsupported"},
      {R"({"prompt": "a", "temprature": 1})", "temprature", "unknown_field"},
      {R"({"prompt": "a", "kv_policy": "nope"})", "kv_policy", "unknown_policy"},
      {R"({"prompt": "a", "kv_policy": 3})", "kv_policy", "invalid_type"},
      {R"({"prompt": "a", "kv_policy": "window", "kv_budget": 0})", "kv_budget", "invalid_value"},
      {R"({"prompt": "a", "kv_policy": "window", "kv_budget": 1.5})", "kv_budget", "invalid_value"},
      {R"({"prompt": "a", "kv_policy": "full", "kv_budget": 0.5})", "kv_budget", "invalid_value"},
      {R"({"prompt": "a", "kv_policy": "window", "kv_budget": 0.5, "kv_options": {"bogus": 1}})", "kv_options",
       "invalid_value"},
      {R"({"prompt": "a", "kv_policy": "window", "kv_budget": 0.5, "kv_options": {"n_sink": "x"}})", "kv_options",
       "invalid_value"},
      {R"({"prompt": "a", "kv_policy": "minimax", "kv_budget": 1, "kv_options": {"max_rel_error": 0.05}})",
       "kv_options", "invalid_value"},
      {R"({"prompt": ")" + std::string(90, 'c') + R"(", "max_tokens": 400, "model": "tiny"})", "max_tokens",
       "context_length_exceeded"},
      {R"({"prompt": "a", "model": "gpt-4"})", "model", "model_not_found", 404},
      {R"({"prompt": ")" + std::string(5000, 'b') + R"("})", "body", "body_too_large"},
  };
  for (const Case& c : cases) {
    const auto [status, j] = post(c.body);
    const std::string shown = c.body.substr(0, 80);
    EXPECT_EQ(status, c.status) << shown;
    ASSERT_TRUE(j.is_object() && j.contains("error")) << shown;
    const json& e = j["error"];
    EXPECT_FALSE(e["message"].get<std::string>().empty()) << shown;
    EXPECT_TRUE(e["type"].is_string()) << shown;
    if (c.param.empty()) {
      EXPECT_TRUE(e["param"].is_null()) << shown << ": " << e.dump();
    } else {
      EXPECT_EQ(e["param"], c.param) << shown << ": " << e.dump();
    }
    EXPECT_EQ(e["code"], c.code) << shown << ": " << e.dump();
  }
  {
    const auto [status, j] = post(R"({"prompt": "a", "max_tokens": 1e30})");
    EXPECT_NE(j["error"]["message"].get<std::string>().find("must be in [1, 400] (serve.max_tokens), got 1e+30"),
              std::string::npos) << j.dump();
  }
  // A whole float in range is that integer: the same answer as the integer.
  const json as_float = s.complete({{"prompt", "abc"}, {"max_tokens", 5.0}, {"temperature", 0}, {"return_bytes", true}}).json;
  const json as_integer = s.complete({{"prompt", "abc"}, {"max_tokens", 5}, {"temperature", 0}, {"return_bytes", true}}).json;
  ASSERT_TRUE(as_float.contains("choices")) << as_float.dump();
  EXPECT_EQ(as_float["usage"]["completion_tokens"], 5);
  EXPECT_EQ(bytes_of(as_float), bytes_of(as_integer));
  // A nested value is named by its type, never echoed: dump() recursed through 100,000 levels of '[' and overflowed
  // the worker's stack (found by review); the message stays short whatever the value.
  for (const std::string key : {"n", "kv_options"}) {
    const std::string deep = std::string(1500, '[') + std::string(1500, ']');
    const std::string body = key == "n" ? R"({"prompt": "a", "n": )" + deep + "}"
                                        : R"({"prompt": "a", "kv_policy": "window", "kv_budget": 0.5, "kv_options": {"n_sink": )" + deep + "}}";
    const auto [status, j] = post(body);
    EXPECT_EQ(status, 400) << key;
    ASSERT_TRUE(j.is_object() && j.contains("error")) << key;
    EXPECT_LT(j["error"]["message"].get<std::string>().size(), 200u) << j.dump().substr(0, 300);
  }
  // Not a route; the wrong method.
  EXPECT_EQ(serve::get("127.0.0.1", s.port, "/v2/nothing").first, 404);
  const auto wrong = serve::get("127.0.0.1", s.port, "/v1/completions");
  EXPECT_EQ(wrong.first, 404);
  EXPECT_EQ(json::parse(wrong.second)["error"]["code"], "not_found");
  // Nothing was admitted, and the server still answers.
  EXPECT_EQ(s.metric("dcp_requests_total", "status=\"400\""), static_cast<double>(cases.size() - 1 + 2 + 1));
  EXPECT_EQ(s.complete({{"prompt", "still here"}, {"max_tokens", 3}}).status, 200);
}

TEST_F(ServeTest, ASecondServerOnAPortInUseIsRefused) {
  // Found by review: with cpp-httplib's default SO_REUSEPORT a second server bound the same port and the kernel
  // split the connections between the two models.
  Running first(tiny_config());
  Config cfg = tiny_config();
  cfg.serve.port = first.port;
  Server second(tiny_model(), cfg, "second");
  try {
    second.bind();
    FAIL() << "a second server bound port " << first.port;
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot listen on 127.0.0.1:" + std::to_string(first.port)), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(first.complete({{"prompt", "still here"}, {"max_tokens", 3}}).status, 200);
}

TEST_F(ServeTest, ModelsHealthMetricsAndThePage) {
  Running s(tiny_config());
  const auto models = serve::get("127.0.0.1", s.port, "/v1/models");
  ASSERT_EQ(models.first, 200);
  const json m = json::parse(models.second);
  EXPECT_EQ(m["data"][0]["id"], "tiny");
  EXPECT_EQ(m["data"][0]["max_context"], kContext);
  EXPECT_EQ(serve::get("127.0.0.1", s.port, "/health").second, R"({"status":"ok"})");
  s.complete({{"prompt", "x"}, {"max_tokens", 5}});
  const std::string text = s.metrics();
  for (const char* name : {"dcp_requests_total", "dcp_prompt_tokens_total", "dcp_completion_tokens_total",
                           "dcp_sessions_active", "dcp_sessions_queued", "dcp_kv_bytes", "dcp_kv_memory_bytes",
                           "dcp_time_to_first_token_seconds_bucket", "dcp_inter_token_latency_seconds_count",
                           "process_resident_memory_bytes"}) {
    EXPECT_NE(text.find(name), std::string::npos) << name;
  }
  EXPECT_EQ(serve::metric(text, "dcp_completion_tokens_total"), 5);
  EXPECT_EQ(serve::metric(text, "dcp_time_to_first_token_seconds_count"), 1);
  EXPECT_EQ(serve::metric(text, "dcp_inter_token_latency_seconds_count"), 4);
  EXPECT_EQ(serve::metric(text, "dcp_saturated_seconds_total"), 0);  // the one request never waited
  EXPECT_EQ(serve::metric(text, "dcp_saturated_session_seconds_total"), 0);
  const auto page = serve::get("127.0.0.1", s.port, "/");
  EXPECT_EQ(page.first, 200);
  EXPECT_NE(page.second.find("<textarea id=\"prompt\""), std::string::npos);
  EXPECT_NE(page.second.find("<option value=\"minimax\""), std::string::npos);
  EXPECT_EQ(page.second.find("http"), page.second.find("http-equiv"));  // no external asset (no URL at all)
}

// A shutdown with a stream in flight: it finishes within the grace, new connections are refused, run() returns.
// With a grace shorter than the stream, the stream ends with an error event and run() still returns.
TEST_F(ServeTest, ShutdownLetsInFlightRequestsFinishThenCancelsTheRest) {
  {
    Config cfg = tiny_config();
    Running s(cfg);
    ClientReply r;
    std::thread client([&] { r = s.complete({{"prompt", "finish me"}, {"max_tokens", 300}, {"stream", true}, {"temperature", 0}}); });
    ASSERT_TRUE(s.wait_for([&] { return s.metric("dcp_sessions_active") == 1; }));
    s.server->shutdown();
    s.thread.join();  // run() returned: every connection was answered
    client.join();
    EXPECT_EQ(r.status, 200);
    EXPECT_TRUE(r.done);
    EXPECT_EQ(r.last["choices"][0]["finish_reason"], "length");
    EXPECT_EQ(serve::complete("127.0.0.1", s.port, {{"prompt", "late"}}, 2).status, 0);  // nobody listens
  }
  {
    Config cfg = tiny_config();
    cfg.serve.shutdown_grace_s = 0.3;
    cfg.serve.max_context = 40000;
    cfg.serve.max_tokens = 30000;
    Running s(cfg);
    ClientReply stream, whole;
    std::thread a([&] { stream = s.complete({{"prompt", "long"}, {"max_tokens", 30000}, {"stream", true}, {"temperature", 0}}); });
    std::thread b([&] { whole = s.complete({{"prompt", "long too"}, {"max_tokens", 30000}, {"temperature", 0}}); });
    ASSERT_TRUE(s.wait_for([&] { return s.metric("dcp_sessions_active") == 2; }));
    const auto t0 = std::chrono::steady_clock::now();
    s.server->shutdown();
    s.thread.join();
    a.join();
    b.join();
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
    EXPECT_EQ(stream.status, 200);
    EXPECT_TRUE(stream.done);
    ASSERT_FALSE(stream.events.empty());
    EXPECT_EQ(stream.events.back()["error"]["code"], "server_shutdown") << stream.events.back().dump();
    EXPECT_EQ(whole.status, 503);
    EXPECT_EQ(whole.json["error"]["code"], "server_shutdown");
  }
}

// 2,000 requests from 8 clients: whole and streamed, compressed, cancelled mid-stream, refused as bad input.
// Afterwards no session, no KV byte and no reservation is left, and resident memory is back at the level it had
// after the first 200 (a warm-up: allocator arenas and LibTorch's first allocations stay). The bound, 24 MiB, is
// well below what keeping the caches would cost (each request's cache is 0.1-0.4 MB; 2,000 of them 200+ MB).
TEST_F(ServeTest, TwoThousandMixedRequestsLeaveNoKvBytesAndNoResidentGrowth) {
  Config cfg = tiny_config();
  cfg.serve.max_queue = 64;
  Running s(cfg);
  std::atomic<int> ok{0}, bad{0}, cancelled{0}, other{0};
  auto one = [&](int i) {
    const int kind = i % 5;
    json body = {{"prompt", std::string(1 + (i * 13) % 60, static_cast<char>('a' + i % 26))},
                 {"max_tokens", 4 + i % 9},
                 {"temperature", 0.8},
                 {"seed", i}};
    if (kind == 1) body["stream"] = true;
    if (kind == 2) {
      body["kv_policy"] = i % 2 ? "window" : "snapkv";
      body["kv_budget"] = 0.5;
    }
    if (kind == 3) {
      body["stream"] = true;
      body["max_tokens"] = 200;
      const ClientReply r = s.complete(body, [](const ClientReply& so_far) { return so_far.events.empty(); });
      (r.done ? other : cancelled)++;
      return;
    }
    if (kind == 4) body["max_tokens"] = -1;
    const ClientReply r = s.complete(body);
    if (r.status == 200) {
      ok++;
    } else if (r.status == 400) {
      bad++;
    } else {
      other++;
    }
  };
  auto run = [&](int from, int to) {
    std::atomic<int> next{from};
    std::vector<std::thread> clients;
    for (int c = 0; c < 8; ++c) {
      clients.emplace_back([&] {
        for (int i = next++; i < to; i = next++) one(i);
      });
    }
    for (auto& t : clients) t.join();
  };
  auto quiet = [&] {
    return s.wait_for([&] {
      const std::string m = s.metrics();
      return serve::metric(m, "dcp_sessions_active") == 0 && serve::metric(m, "dcp_sessions_queued") == 0;
    });
  };
  run(0, 200);
  ASSERT_TRUE(quiet());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the scheduler trims the heap when it goes idle
  const double warm = s.metric("process_resident_memory_bytes");
  run(200, 2200);
  ASSERT_TRUE(quiet()) << s.metrics();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const std::string m = s.metrics();
  EXPECT_EQ(ok + bad + cancelled + other, 2200);
  EXPECT_EQ(other, 0);
  EXPECT_EQ(bad, 440);
  EXPECT_GT(cancelled, 400);
  EXPECT_EQ(serve::metric(m, "dcp_kv_bytes"), 0);
  EXPECT_EQ(serve::metric(m, "dcp_kv_capacity_bytes"), 0);
  EXPECT_EQ(serve::metric(m, "dcp_kv_held_bytes"), 0);
  const double end = serve::metric(m, "process_resident_memory_bytes");
  std::cout << "resident memory after 200 requests " << warm / 1e6 << " MB, after 2200 " << end / 1e6 << " MB\n";
  EXPECT_LT(end, warm + 24.0 * (1 << 20)) << "warm " << warm << ", end " << end;
}

// A flexformer model is served from recurrent states (RecurrentSession): completions, whole and streamed, alone
// and 8 at once under both schedulers, equal generate() with the same seed; each session reserves and holds its
// states' bytes, the same for a 1-byte and a 73-byte prompt; cache policies, budgets and options are refused with
// a 400 naming the field; memory admission counts the states (room for 2: the third waits).
TEST_F(ServeTest, FlexformerModelsAreServedFromRecurrentStates) {
  auto flex_model = [] {
    torch::manual_seed(23);
    AttentionConfig a;
    a.backend = "flexformer";
    a.num_features = 8;
    a.chunk_size = 4;
    Transformer model(dcp::test::kv_tiny_config(2), a, Precision::kFp32);
    model->eval();
    return model;
  };
  auto flex_reference = [&](const std::string& prompt, int64_t max_tokens, double temperature, uint64_t seed) {
    Transformer model = flex_model();
    return generate(model, prompt, server_options(max_tokens, temperature, seed));
  };
  // 2 layers x 4 heads x (2 x 8 + 1 features) x (16 + 1) fp32 values.
  const int64_t state_bytes = 2 * 4 * 17 * 17 * 4;
  for (const std::string scheduler : {"batched", "sequential"}) {
    Config cfg = tiny_config();
    cfg.attention.backend = "flexformer";
    cfg.serve.scheduler = scheduler;
    Running s(cfg, flex_model());
    const int n = 8;
    std::vector<json> bodies(n);
    std::vector<ClientReply> replies(n);
    for (int i = 0; i < n; ++i) {
      bodies[i] = {{"prompt", i == 0 ? std::string("a") : std::string(70, static_cast<char>('a' + i)) + "abc"},
                   {"max_tokens", 20 + 3 * i},
                   {"temperature", i % 3 == 0 ? 0.0 : 0.9},
                   {"seed", 200 + i},
                   {"return_bytes", true},
                   {"stream", i % 2 == 1}};
    }
    std::vector<std::thread> clients;
    for (int i = 0; i < n; ++i) clients.emplace_back([&, i] { replies[i] = s.complete(bodies[i]); });
    for (auto& t : clients) t.join();
    for (int i = 0; i < n; ++i) {
      ASSERT_EQ(replies[i].status, 200) << scheduler << " client " << i << ": " << replies[i].body.substr(0, 400);
      const bool streamed = bodies[i]["stream"];
      EXPECT_EQ(streamed ? replies[i].bytes : bytes_of(replies[i].json),
                flex_reference(bodies[i]["prompt"], bodies[i]["max_tokens"], bodies[i]["temperature"], bodies[i]["seed"]))
          << scheduler << " client " << i;
      if (!streamed) {
        const json& kv = replies[i].json["kv_cache"];
        EXPECT_EQ(kv["policy"], "full");
        EXPECT_EQ(kv["bytes"], state_bytes) << "client " << i;
        EXPECT_EQ(kv["peak_bytes"], state_bytes);
        EXPECT_EQ(kv["reserved_bytes"], state_bytes);
        EXPECT_EQ(kv["abstained"], false);
      }
    }
    ASSERT_TRUE(s.wait_for([&] { return s.metric("dcp_kv_held_bytes") == 0; })) << s.metrics();
    EXPECT_EQ(s.metric("dcp_kv_bytes"), 0);
    EXPECT_EQ(s.metric("dcp_requests_total", "status=\"200\""), n);
  }
  Config cfg = tiny_config();
  cfg.attention.backend = "flexformer";
  cfg.serve.kv_memory_bytes = 2.5 * state_bytes;
  Running s(cfg, flex_model());
  const json m = json::parse(serve::get("127.0.0.1", s.port, "/v1/models").second);
  EXPECT_EQ(m["data"][0]["attention"], "flexformer");
  EXPECT_EQ(m["data"][0]["kv_policies"], json::array({"full"}));
  const std::string page = serve::get("127.0.0.1", s.port, "/").second;
  EXPECT_NE(page.find("recurrent states held"), std::string::npos);
  EXPECT_NE(page.find("<option value=\"full\" selected>"), std::string::npos);
  EXPECT_EQ(page.find("<option value=\"window\""), std::string::npos);
  for (const auto& [body, param] : std::vector<std::pair<json, std::string>>{
           {{{"prompt", "a"}, {"kv_policy", "window"}}, "kv_policy"},
           {{{"prompt", "a"}, {"kv_policy", "minimax"}, {"kv_budget", 0.25}}, "kv_policy"},
           {{{"prompt", "a"}, {"kv_budget", 0.5}}, "kv_budget"},
           {{{"prompt", "a"}, {"kv_options", {{"window", 8}}}}, "kv_options"}}) {
    const ClientReply r = s.complete(body);
    EXPECT_EQ(r.status, 400) << body.dump();
    EXPECT_EQ(r.json["error"]["param"], param) << r.body;
    EXPECT_NE(r.json["error"]["message"].get<std::string>().find("flexformer"), std::string::npos) << r.body;
  }
  // Room for two sessions' states: three long requests at once, the third queued until one finishes.
  std::vector<ClientReply> replies(3);
  std::vector<std::thread> clients;
  for (int i = 0; i < 3; ++i) {
    clients.emplace_back([&, i] {
      replies[i] = s.complete({{"prompt", "q"}, {"max_tokens", 300}, {"temperature", 0.8}, {"seed", i}});
    });
  }
  ASSERT_TRUE(s.wait_for([&] { return s.metric("dcp_sessions_queued") == 1; })) << s.metrics();
  EXPECT_EQ(s.metric("dcp_sessions_active"), 2);
  EXPECT_EQ(s.metric("dcp_kv_held_bytes"), 2 * state_bytes);
  for (auto& t : clients) t.join();
  for (const auto& r : replies) EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(s.wait_for([&] { return s.metric("dcp_kv_held_bytes") == 0; })) << s.metrics();
}
