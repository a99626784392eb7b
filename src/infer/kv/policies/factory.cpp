// make_kv_policy: policies by name, with their options checked.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "dcp/kv_policies.h"
#include "infer/kv/policies/adakv.h"
#include "infer/kv/policies/expected_attention.h"
#include "infer/kv/policies/h2o.h"
#include "infer/kv/policies/keydiff.h"
#include "infer/kv/policies/minimax.h"
#include "infer/kv/policies/scored.h"
#include "infer/kv/policies/snapkv.h"
#include "infer/kv/policies/tova.h"
#include "infer/kv/policies/window.h"
#include "util/number_text.h"

namespace dcp {
namespace {

// The valid names for an error message, from the one list (kv_policy_names).
std::string valid_names() { return fmt::format("{}", fmt::join(kv_policy_names(), ", ")); }

// The options of one policy: each read once with its default and range; anything left over is not an option
// of this policy.
class Options {
 public:
  Options(std::string policy, const KvPolicyOptions& given) : policy_(std::move(policy)), given_(given) {}

  double number(const std::string& key, double fallback, double lo, double hi, bool lo_open = false) {
    taken_.push_back(key);
    const auto it = given_.find(key);
    if (it == given_.end()) return fallback;
    const double v = it->second;
    if (!(lo_open ? v > lo : v >= lo) || !(v <= hi)) {
      throw std::invalid_argument(fmt::format("make_kv_policy: {}: {} = {} outside {}{}, {}]", policy_, key, v,
                                              lo_open ? "(" : "[", lo, hi));
    }
    return v;
  }
  int64_t integer(const std::string& key, int64_t fallback, int64_t lo, int64_t hi = int64_t{1000000000000000}) {
    const double v = number(key, static_cast<double>(fallback), static_cast<double>(lo), static_cast<double>(hi));
    if (v != std::floor(v)) {
      throw std::invalid_argument(fmt::format("make_kv_policy: {}: {} = {} is not an integer", policy_, key, v));
    }
    return static_cast<int64_t>(v);
  }
  KvBudget budget() {
    KvBudget b;
    b.ratio = number("budget", 1.0, 0.0, 1.0, /*lo_open=*/true);
    b.interval = integer("interval", kKvDefaultInterval, 1);
    b.max_tokens = integer("max_tokens", 0, 0);
    return b;
  }
  bool flag(const std::string& key, bool fallback = false) {
    const int64_t v = integer(key, fallback ? 1 : 0, 0);
    if (v > 1) throw std::invalid_argument(fmt::format("make_kv_policy: {}: {} = {} must be 0 or 1", policy_, key, v));
    return v == 1;
  }
  // Throws for an option that no read took.
  void finish() const {
    for (const auto& [key, value] : given_) {
      if (std::find(taken_.begin(), taken_.end(), key) == taken_.end()) {
        throw std::invalid_argument(fmt::format("make_kv_policy: {} has no option '{}' (value {}); its options: {}",
                                                policy_, key, value,
                                                taken_.empty() ? std::string("none") : fmt::format("{}", fmt::join(taken_, ", "))));
      }
    }
  }

 private:
  std::string policy_;
  const KvPolicyOptions& given_;
  std::vector<std::string> taken_;
};

// The scorer `name`. Every policy compresses on the same schedule by default (kKvDefaultInterval), so that they
// hold the same bytes while decoding (a policy compressing less often holds up to interval - 1 more entries).
std::shared_ptr<const KvScorer> make_scorer(const std::string& name, Options& o) {
  if (name == "window") return std::make_shared<WindowScorer>(o.integer("n_sink", 4, 0));
  if (name == "h2o") return std::make_shared<H2oScorer>(o.number("recent_fraction", 0.5, 0.0, 1.0));
  if (name == "snapkv") {
    const int64_t window = o.integer("window", 64, 1);
    const int64_t kernel = o.integer("kernel", 5, 1);
    if (kernel % 2 == 0) throw std::invalid_argument(fmt::format("make_kv_policy: snapkv: kernel = {} must be odd", kernel));
    return std::make_shared<SnapKvScorer>(window, kernel);
  }
  if (name == "tova") return std::make_shared<TovaScorer>();
  if (name == "expected-attention") {
    const int64_t future = o.integer("n_future_positions", 512, 1, 1 << 24);
    const int64_t n_sink = o.integer("n_sink", 4, 0);
    const int64_t vnorm = o.integer("value_norm", 1, 0, 1);
    return std::make_shared<ExpectedAttentionScorer>(future, n_sink, vnorm == 1);
  }
  if (name == "keydiff") return std::make_shared<KeyDiffScorer>();
  return nullptr;
}

}  // namespace

const std::vector<std::string>& kv_policy_names() {
  static const std::vector<std::string> names{"full",        "window",       "h2o",
                                              "snapkv",      "tova",         "expected-attention",
                                              "keydiff",     "adakv-h2o",    "adakv-snapkv",
                                              "adakv-tova",  "adakv-expected-attention",
                                              "adakv-keydiff", "minimax"};
  return names;
}

std::shared_ptr<KvPolicy> make_kv_policy(const std::string& name, const KvPolicyOptions& options) {
  Options o(name, options);
  if (name == "full") {
    o.finish();
    return std::make_shared<FullKvPolicy>();
  }
  if (name == "minimax") {
    MinimaxOptions m;
    m.budget = o.budget();
    // Reference queries cost Q x entries fp32 probabilities and Q n^2 Gram flops per head: bounded so that a typo
    // cannot ask for terabytes.
    m.window = o.integer("window", m.window, 1, 65536);
    m.samples = o.integer("samples", m.samples, 0, 65536);
    m.probes = o.integer("probes", m.probes, 0, 65536);
    m.n_sink = o.integer("n_sink", m.n_sink, 0);
    m.recent_fraction = o.number("recent_fraction", m.recent_fraction, 0.0, 1.0);
    m.recent_tokens = o.integer("recent_tokens", m.recent_tokens, 0);
    m.alpha_safeguard = o.number("alpha_safeguard", m.alpha_safeguard, 0.0, 1.0);
    m.abstain_tail = o.number("abstain_tail", m.abstain_tail, 0.0, 1e300);
    m.abstain_heldout = o.number("abstain_heldout", m.abstain_heldout, 0.0, 1e300);
    m.exceed_budget = o.flag("exceed_budget");
    m.unit_weights = o.flag("unit_weights");
    m.max_rel_error = o.number("max_rel_error", m.max_rel_error, 0.0, 1e300);
    m.refit_values = o.flag("refit_values");
    m.merge = o.flag("merge", m.merge);
    m.max_keep_fraction = o.number("max_keep_fraction", m.max_keep_fraction, 0.0, 1.0, /*lo_open=*/true);
    // Screening is a budget-mode device: an explicit fraction below 1 beside an error target would be ignored.
    if (options.count("max_keep_fraction") > 0 && m.max_keep_fraction < 1 && m.max_rel_error > 0) {
      throw std::invalid_argument(fmt::format(
          "make_kv_policy: minimax: max_keep_fraction = {} (screening, a budget-mode option) cannot be used with "
          "the error target max_rel_error = {} (set by kv.max_rel_bpb, kv-eval --max-rel-bpb or kv-calibrate's "
          "grid): leave max_keep_fraction out or set it to 1",
          m.max_keep_fraction, m.max_rel_error));
    }
    m.seed = static_cast<uint64_t>(o.integer("seed", 0, 0));
    o.finish();
    return std::make_shared<MinimaxKvPolicy>(m);
  }
  const std::string ada = "adakv-";
  const bool adakv = name.compare(0, ada.size(), ada) == 0;
  // Ada-KV ranks entries of all heads of a layer against each other; window's scores are positions, which
  // say nothing across heads (every head would keep the same newest entries, as plain window does).
  if (name == ada + "window") {
    throw std::invalid_argument(fmt::format("make_kv_policy: '{}' is not a policy (window scores do not compare "
                                            "across heads); valid: {}", name, valid_names()));
  }
  auto scorer = make_scorer(adakv ? name.substr(ada.size()) : name, o);
  if (!scorer) {
    throw std::invalid_argument(fmt::format("make_kv_policy: unknown policy '{}'; valid: {}", name, valid_names()));
  }
  const KvBudget budget = o.budget();
  if (adakv) {
    const double alpha = o.number("alpha_safeguard", 0.2, 0.0, 1.0);
    o.finish();
    return std::make_shared<AdaKvPolicy>(std::move(scorer), budget, alpha);
  }
  o.finish();
  return std::make_shared<ScoredKvPolicy>(std::move(scorer), budget);
}

std::shared_ptr<KvPolicy> make_kv_policy_with_budget(const std::string& name, double budget,
                                                         KvPolicyOptions options) {
  const bool fraction = budget > 0 && budget <= 1;
  const bool tokens = budget >= 2 && budget <= 1e15 && budget == std::floor(budget);
  if (!fraction && !tokens) {
    throw std::invalid_argument(fmt::format(
        "KV budget {} must be a fraction in (0, 1] of the tokens seen or a whole number >= 2 of entries per head", budget));
  }
  for (const char* key : {"budget", "max_tokens"}) {
    if (options.count(key) != 0) {
      throw std::invalid_argument(fmt::format(
          "KV option {} = {} is set by the budget ({}), not as an option of the policy", key, options.at(key), budget));
    }
  }
  if (name == "full") {
    if (budget != 1) {
      throw std::invalid_argument(fmt::format("KV policy full keeps every entry; budget {} needs another policy ({})",
                                              budget, valid_names()));
    }
    return make_kv_policy(name, options);
  }
  if (fraction) {
    options["budget"] = budget;
  } else {
    options["max_tokens"] = budget;
  }
  return make_kv_policy(name, options);
}

void add_kv_policy_option(const std::string& item, KvPolicyOptions& options) {
  const auto eq = item.find('=');
  const std::optional<double> value = eq == std::string::npos ? std::nullopt : parse_decimal(item.substr(eq + 1));
  if (eq == 0 || !value || !std::isfinite(*value)) {
    throw std::invalid_argument(fmt::format("KV policy option '{}': expected KEY=VALUE with a finite decimal VALUE",
                                            item));
  }
  if (!options.emplace(item.substr(0, eq), *value).second) {
    throw std::invalid_argument(fmt::format("KV policy option '{}': {} is given twice", item, item.substr(0, eq)));
  }
}

KvPolicySpec parse_kv_policy_spec(const std::string& spec) {
  KvPolicySpec out;
  const auto colon = spec.find(':');
  out.name = spec.substr(0, colon);
  if (out.name.empty()) throw std::invalid_argument(fmt::format("KV policy '{}': no policy name before ':'", spec));
  for (size_t at = colon; at != std::string::npos;) {
    const auto next = spec.find(':', at + 1);
    try {
      add_kv_policy_option(spec.substr(at + 1, next == std::string::npos ? std::string::npos : next - at - 1),
                           out.options);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(fmt::format("KV policy '{}': {}", spec, e.what()));
    }
    at = next;
  }
  return out;
}

}  // namespace dcp
