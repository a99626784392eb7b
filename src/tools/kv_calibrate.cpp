// `dcp kv-calibrate`'s driver: minimax at a grid of max_rel_error values, the choice per bits-per-byte target, and
// the calibration file (src/tools/kv_calibrate.h).
#include "tools/kv_calibrate.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "dcp/kv_policies.h"
#include "util/hash.h"

namespace dcp {

void KvCalibrationOptions::validate() const {
  if (grid.empty() || targets.empty()) throw std::invalid_argument("kv-calibrate: the grid and the targets must not be empty");
  for (double g : grid) {
    if (!(g > 0)) throw std::invalid_argument(fmt::format("kv-calibrate: grid value {} must be > 0", g));
  }
  for (double t : targets) {
    if (!(t > 0)) throw std::invalid_argument(fmt::format("kv-calibrate: target {} must be > 0", t));
  }
  if (const auto g = kv_first_repeat(grid); g != grid.end()) {
    throw std::invalid_argument(fmt::format("kv-calibrate: grid value {} is given twice", *g));
  }
  if (const auto t = kv_first_repeat(targets); t != targets.end()) {
    throw std::invalid_argument(fmt::format("kv-calibrate: target {} is given twice", *t));
  }
  if (!(coverage > 0 && coverage < 1)) {
    throw std::invalid_argument(fmt::format("kv-calibrate: coverage {} must lie in (0, 1)", coverage));
  }
  // Only minimax sizes its cache by an error target; the grid sets max_rel_error (and budget 1) itself.
  const KvPolicySpec spec = parse_kv_policy_spec(policy);
  if (spec.name != "minimax") {
    throw std::invalid_argument(fmt::format("kv-calibrate: --policy {}: only minimax takes an error target "
                                            "(max_rel_error)",
                                            policy));
  }
  if (const char* key = kv_target_set_option(spec.options)) {
    throw std::invalid_argument(fmt::format("kv-calibrate: --policy {} sets {}; the grid sets it", policy, key));
  }
  KvEvalOptions o = eval;
  o.policies = {"full"};
  o.budgets = {1.0};
  o.targets.clear();
  for (double g : grid) o.targets.push_back(KvEvalTarget{1.0, g, 0, 0, policy});
  o.validate();
}

KvCalibration run_kv_calibration(Transformer& model, const std::vector<KvEvalDocument>& documents,
                                 const KvCalibrationOptions& options,
                                 const std::function<void(int64_t, int64_t)>& on_document) {
  options.validate();
  std::vector<double> grid = options.grid, targets = options.targets;
  std::sort(grid.begin(), grid.end());
  std::sort(targets.begin(), targets.end());
  KvEvalOptions o = options.eval;
  o.policies = {"full"};  // the reference runs anyway; full's row is what every increase is relative to
  o.budgets = {1.0};
  o.targets.clear();
  // The target field of these rows is unused (the grid point is the option); 1 keeps validate() satisfied.
  for (double g : grid) o.targets.push_back(KvEvalTarget{1.0, g, 0, 0, options.policy});
  o.paired_against.clear();
  const KvEvalResult r = run_kv_eval(model, documents, o, on_document);
  KvCalibration c;
  c.policy = options.policy;
  c.coverage = options.coverage;
  c.context = o.context;
  c.continuation = o.continuation;
  c.documents = static_cast<int64_t>(documents.size());
  c.source_files = r.source_files;
  c.sources = r.files;
  c.weights = kv_weights_fingerprint(model);
  for (const auto& row : r.rows) {
    if (!row.target) continue;  // full
    KvCalibrationPoint p;
    p.max_rel_error = row.target->max_rel_error;
    p.mean = row.rel_bpb_increase.value;
    p.q90 = kv_quantile_with_ci(row.rel_per_document, options.coverage).value;
    p.bound = kv_conformal_bound(row.rel_per_document, options.coverage);
    p.bytes_ratio = row.kv_bytes_mean / row.kv_bytes_full_mean;
    c.grid.push_back(p);
  }
  for (double t : targets) {
    KvCalibration::Choice choice;
    choice.max_rel_bpb = t;
    for (const auto& p : c.grid) {  // ascending: the last one that holds is the largest
      if (p.bound <= t) {
        choice.max_rel_error = p.max_rel_error;
        choice.q90 = p.q90;
        choice.bound = p.bound;
        choice.bytes_ratio = p.bytes_ratio;
      }
    }
    c.choices.push_back(choice);
  }
  return c;
}

nlohmann::json kv_calibration_json(const KvCalibration& c) {
  nlohmann::json grid = nlohmann::json::array(), choices = nlohmann::json::array();
  for (const auto& p : c.grid) {
    // +inf (too few documents to bound) is written as null.
    grid.push_back({{"max_rel_error", p.max_rel_error}, {"mean", p.mean}, {"q90", p.q90}, {"bytes_ratio", p.bytes_ratio},
                    {"bound", std::isfinite(p.bound) ? nlohmann::json(p.bound) : nlohmann::json(nullptr)}});
  }
  for (const auto& ch : c.choices) {
    choices.push_back({{"max_rel_bpb", ch.max_rel_bpb},
                       {"max_rel_error", ch.max_rel_error},
                       {"q90", ch.q90},
                       {"bound", ch.bound},
                       {"bytes_ratio", ch.bytes_ratio}});
  }
  nlohmann::json j = {{"format", "dcp-kv-calibration-1"},
          {"policy", c.policy},
          {"coverage", c.coverage},
          {"context", c.context},
          {"continuation", c.continuation},
          {"documents", c.documents},
          {"source_files", c.source_files},
          {"checkpoint", c.checkpoint},
          {"data_path", c.data_path},
          {"split", c.split},
          {"date", c.date},
          {"sources", c.sources},
          {"grid", grid},
          {"choices", choices}};
  if (!c.weights.empty()) j["weights"] = c.weights;  // absent: not checkable (an empty one is a bad file)
  return j;
}

KvCalibration kv_calibration_from_json(const nlohmann::json& j, const std::string& what) {
  auto fail = [&](const std::string& field, const std::string& why) {
    return std::runtime_error(fmt::format("KV calibration '{}': field '{}' {}", what, field, why));
  };
  if (!j.is_object() || j.value("format", std::string()) != "dcp-kv-calibration-1") {
    throw fail("format", "is not dcp-kv-calibration-1 (not a file `dcp kv-calibrate` wrote)");
  }
  auto number = [&](const nlohmann::json& o, const char* key, const std::string& at) {
    if (!o.contains(key) || !o[key].is_number()) throw fail(at + key, "is missing or not a number");
    return o[key].get<double>();
  };
  KvCalibration c;
  if (!j.contains("policy") || !j["policy"].is_string()) throw fail("policy", "is missing or not a string");
  c.policy = j["policy"].get<std::string>();
  c.coverage = number(j, "coverage", "");
  c.context = static_cast<int64_t>(number(j, "context", ""));
  c.continuation = static_cast<int64_t>(number(j, "continuation", ""));
  c.documents = static_cast<int64_t>(number(j, "documents", ""));
  c.source_files = static_cast<int64_t>(number(j, "source_files", ""));
  if (!(c.coverage > 0 && c.coverage < 1)) throw fail("coverage", fmt::format("{} is not in (0, 1)", c.coverage));
  // Counts kv-calibrate writes: at least one document of one file, a context and a continuation of >= 1 token.
  for (const auto& [field, value] : {std::pair<const char*, int64_t>{"context", c.context},
                                     {"continuation", c.continuation}, {"documents", c.documents},
                                     {"source_files", c.source_files}}) {
    if (value < 1) throw fail(field, fmt::format("{} must be >= 1", value));
  }
  c.checkpoint = j.value("checkpoint", std::string());
  c.data_path = j.value("data_path", std::string());
  c.split = j.value("split", std::string());
  c.date = j.value("date", std::string());
  if (j.contains("weights")) {
    if (!j["weights"].is_string() || j["weights"].get<std::string>().empty()) {
      throw fail("weights", fmt::format("is {}, not a fingerprint (leave the field out for a file without one)",
                                        j["weights"].dump()));
    }
    c.weights = j["weights"].get<std::string>();
  }
  if (j.contains("sources")) {
    if (!j["sources"].is_array()) throw fail("sources", "is not an array");
    for (const auto& s : j["sources"]) {
      if (!s.is_string()) throw fail("sources", fmt::format("holds {}, not a string", s.dump()));
      c.sources.push_back(s.get<std::string>());
    }
    std::sort(c.sources.begin(), c.sources.end());
  }
  for (const char* list : {"grid", "choices"}) {
    if (!j.contains(list) || !j[list].is_array()) throw fail(list, "is missing or not an array");
  }
  for (size_t i = 0; i < j["grid"].size(); ++i) {
    const auto& p = j["grid"][i];
    const std::string at = fmt::format("grid[{}].", i);
    KvCalibrationPoint point{number(p, "max_rel_error", at), number(p, "mean", at), number(p, "q90", at),
                             number(p, "bytes_ratio", at)};
    // Files before 2026-12-06 chose by q90 and have no bound; null is +inf.
    point.bound = !p.contains("bound") ? point.q90
                  : p["bound"].is_null() ? std::numeric_limits<double>::infinity()
                                         : number(p, "bound", at);
    c.grid.push_back(point);
  }
  for (size_t i = 0; i < j["choices"].size(); ++i) {
    const auto& p = j["choices"][i];
    const std::string at = fmt::format("choices[{}].", i);
    KvCalibration::Choice ch;
    ch.max_rel_bpb = number(p, "max_rel_bpb", at);
    ch.max_rel_error = number(p, "max_rel_error", at);
    ch.q90 = number(p, "q90", at);
    ch.bound = p.contains("bound") ? number(p, "bound", at) : ch.q90;
    if (ch.max_rel_error > 0 && !(ch.bound <= ch.max_rel_bpb)) {
      throw fail(at + "bound", fmt::format("{} exceeds the target {} it was chosen for", ch.bound, ch.max_rel_bpb));
    }
    ch.bytes_ratio = number(p, "bytes_ratio", at);
    if (!(ch.max_rel_bpb > 0)) throw fail(at + "max_rel_bpb", fmt::format("{} must be > 0", ch.max_rel_bpb));
    // kv-calibrate's --grid takes values up to 1e6; a larger one is not a file it wrote.
    if (!(ch.max_rel_error >= 0 && ch.max_rel_error <= 1e6)) {
      throw fail(at + "max_rel_error",
                 fmt::format("{} must lie in [0, 1e6] (0: no grid value met the target)", ch.max_rel_error));
    }
    // A choice is a grid point (or 0: none met the target).
    if (ch.max_rel_error > 0 && std::none_of(c.grid.begin(), c.grid.end(), [&](const KvCalibrationPoint& g) {
          return g.max_rel_error == ch.max_rel_error;
        })) {
      throw fail(at + "max_rel_error", fmt::format("{} is not a max_rel_error of the grid", ch.max_rel_error));
    }
    c.choices.push_back(ch);
  }
  if (c.choices.empty()) throw fail("choices", "is empty (no target was calibrated)");
  std::sort(c.choices.begin(), c.choices.end(),
            [](const auto& a, const auto& b) { return a.max_rel_bpb < b.max_rel_bpb; });
  for (size_t i = 1; i < c.choices.size(); ++i) {
    if (c.choices[i].max_rel_bpb == c.choices[i - 1].max_rel_bpb) {
      throw fail("choices", fmt::format("lists the target {} twice (kv-calibrate writes one choice per target)",
                                        c.choices[i].max_rel_bpb));
    }
  }
  return c;
}

double kv_conformal_bound(std::vector<double> values, double coverage) {
  if (!(coverage > 0 && coverage < 1)) {
    throw std::invalid_argument(fmt::format("kv_conformal_bound: coverage {} must lie in (0, 1)", coverage));
  }
  const auto n = static_cast<int64_t>(values.size());
  const int64_t rank = kv_conformal_rank(n, coverage);
  if (rank > n) return std::numeric_limits<double>::infinity();
  std::nth_element(values.begin(), values.begin() + (rank - 1), values.end());
  return values[static_cast<size_t>(rank - 1)];
}

int64_t kv_conformal_rank(int64_t n, double coverage) {
  // Less a hair, so that e.g. 33 x 0.9 = 29.700000000000003 stays 30 and 10 x 0.9 stays 9.
  return static_cast<int64_t>(std::ceil(static_cast<double>(n + 1) * coverage - 1e-9));
}

int64_t kv_conformal_min_documents(double coverage) {
  // The smallest n whose rank is at most n, so that the two agree by construction (about c / (1 - c)).
  int64_t n = 1;
  while (kv_conformal_rank(n, coverage) > n) ++n;
  return n;
}

std::string kv_weights_fingerprint(Transformer& model) {
  torch::NoGradGuard no_grad;
  Fnv1a64 h;
  for (const auto& item : model->named_parameters()) {
    const torch::Tensor t = item.value().detach().to(torch::kCPU, torch::kFloat).contiguous();
    h.update(fmt::format("{}:{}|", item.key(), fmt::join(t.sizes(), ",")));
    h.update(t.data_ptr(), static_cast<size_t>(t.numel()) * sizeof(float));
  }
  return fmt::format("{:016x}", h.value());
}

std::string kv_check_calibration_weights(const KvCalibration& c, const std::string& weights, const std::string& path) {
  if (c.weights.empty()) {
    return fmt::format("KV calibration '{}' records no weights fingerprint (written before 2026-12-06): it cannot be "
                       "checked against this checkpoint's model; run dcp kv-calibrate again to tie it",
                       path);
  }
  if (c.weights != weights) {
    throw std::runtime_error(fmt::format("KV calibration '{}' was made for other weights (fingerprint {}, checkpoint "
                                         "'{}'); this checkpoint's are {}: run dcp kv-calibrate on this checkpoint",
                                         path, c.weights, c.checkpoint, weights));
  }
  return "";
}

std::vector<std::string> kv_calibration_overlap(const KvCalibration& c, const std::vector<KvEvalDocument>& documents) {
  const std::vector<std::string> files = kv_source_files(documents);
  std::vector<std::string> out;
  std::set_intersection(files.begin(), files.end(), c.sources.begin(), c.sources.end(), std::back_inserter(out));
  return out;
}

std::string kv_calibration_path(const std::string& checkpoint) {
  return (std::filesystem::path(checkpoint) / "kv_calibration.json").string();
}

KvCalibration read_kv_calibration(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(fmt::format("KV calibration '{}': cannot be read (run dcp kv-calibrate)", path));
  std::stringstream text;
  text << in.rdbuf();
  const nlohmann::json j = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) throw std::runtime_error(fmt::format("KV calibration '{}': not JSON", path));
  return kv_calibration_from_json(j, path);
}

KvEvalTarget kv_calibrated_target(const KvCalibration& c, double max_rel_bpb) {
  const KvCalibration::Choice* use = nullptr;
  for (const auto& ch : c.choices) {
    if (ch.max_rel_bpb <= max_rel_bpb * (1 + 1e-12)) use = &ch;
  }
  if (use == nullptr) {
    throw std::invalid_argument(fmt::format("KV error target {}: the calibration lists no target at or below it "
                                            "(its targets start at {})",
                                            max_rel_bpb, c.choices.empty() ? 0.0 : c.choices.front().max_rel_bpb));
  }
  if (!(use->max_rel_error > 0)) {
    const std::string fallback =
        use->max_rel_bpb < max_rel_bpb * (1 - 1e-12)
            ? fmt::format(" (it takes the choice of the calibrated target {}, the largest listed at or below it)",
                          use->max_rel_bpb)
            : "";
    throw std::invalid_argument(fmt::format("KV error target {}{}: on the calibration documents no max_rel_error of "
                                            "the grid had its conformal bound at coverage {:g} within {} "
                                            "(re-calibrate with a finer grid or more documents)",
                                            max_rel_bpb, fallback, c.coverage, use->max_rel_bpb));
  }
  KvEvalTarget t;
  t.max_rel_bpb = max_rel_bpb;
  t.max_rel_error = use->max_rel_error;
  t.calibrated_q90 = use->q90;
  t.calibrated_bound = use->bound;
  t.calibrated_bytes_ratio = use->bytes_ratio;
  t.policy = c.policy;
  return t;
}

}  // namespace dcp
