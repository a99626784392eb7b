// `dcp kv-eval`'s driver: the documents, the full-cache reference run and one run per (policy, budget).
#include "tools/kv_eval.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>
#include <random>
#include <stdexcept>

#include "dcp/data.h"
#include "dcp/infer.h"
#include "dcp/kv_policies.h"

namespace dcp {
namespace {

bool is_full(const std::string& policy) { return parse_kv_policy_spec(policy).name == "full"; }

// The policy of one row: a spec (parse_kv_policy_spec) with the row's budget; `full` takes none.
std::shared_ptr<KvPolicy> row_policy(const std::string& policy, double budget) {
  KvPolicySpec spec = parse_kv_policy_spec(policy);
  if (spec.name == "full") return make_kv_policy(spec.name, spec.options);
  for (const char* key : {"budget", "max_tokens"}) {
    if (spec.options.count(key) != 0) {
      throw std::invalid_argument(fmt::format("KV evaluation: policy '{}' sets {}; budgets come from the budget list",
                                              policy, key));
    }
  }
  spec.options["budget"] = budget;
  return make_kv_policy(spec.name, spec.options);
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The reference run's policy: keeps everything (as FullKvPolicy) and asks the session to record the last
// `window` queries; after the step that ends at `last_position` it copies them, so that they are exactly the
// continuation's true future queries and outlive the session (which owns the observations).
class RecordingFullCache : public KvPolicy {
 public:
  RecordingFullCache(int64_t layers, int64_t window, int64_t last_position)
      : layers_(layers), window_(window), last_position_(last_position) {}
  void after_step(KvCache&, const KvStep& step) override {
    if (!step.observations || step.first_position + step.tokens - 1 != last_position_) return;
    queries_.clear();
    positions_.clear();
    for (int64_t l = 0; l < layers_; ++l) {
      queries_.push_back(step.observations->window_queries(l).clone());
      positions_.push_back(step.observations->window_positions(l).clone());
    }
    scale_ = step.observations->scale();
  }
  KvObservationNeeds needs() const override { return {window_, false}; }
  /// [heads, window, head_dim] fp32 of `layer`; throws std::logic_error when nothing was recorded.
  const torch::Tensor& queries(int64_t layer) const { return recorded(queries_, layer); }
  const torch::Tensor& positions(int64_t layer) const { return recorded(positions_, layer); }
  double scale() const { return scale_; }

 private:
  const torch::Tensor& recorded(const std::vector<torch::Tensor>& v, int64_t layer) const {
    if (layer < 0 || layer >= static_cast<int64_t>(v.size())) {
      throw std::logic_error(fmt::format("KV evaluation: the reference run recorded no queries of layer {}", layer));
    }
    return v[static_cast<size_t>(layer)];
  }

  int64_t layers_, window_, last_position_;
  std::vector<torch::Tensor> queries_, positions_;
  double scale_ = 0;
};

// Every (layer, head) view of the cache now. Views alias storage that is never written again, so they stay
// the cache as it was after prefill while decoding goes on.
std::vector<KvHeadView> snapshot(const KvCache& cache) {
  std::vector<KvHeadView> views;
  for (int64_t l = 0; l < cache.spec().layers; ++l) {
    for (int64_t h = 0; h < cache.spec().kv_heads; ++h) views.push_back(cache.view(l, h));
  }
  return views;
}

// What one session measured on one document.
struct DocRun {
  double bpb = 0;
  int64_t correct = 0;  // continuation tokens that are their logits' argmax
  int64_t kv_bytes = 0;
  double kv_bytes_mean = 0, kv_bytes_max = 0;  // what each scored token's attention read
  double prefill_s = 0, decode_s = 0;
  std::vector<KvHeadView> after_prefill;  // layer-major
  std::vector<std::pair<int64_t, int64_t>> abstained;  // (layer, head)
};

// Prefills the context, teacher-forces the continuation and scores its true next tokens.
DocRun run_document(Transformer& model, const KvEvalDocument& doc, const KvEvalOptions& o,
                    const std::shared_ptr<KvPolicy>& policy) {
  if (static_cast<int64_t>(doc.tokens.size()) < o.context + o.continuation + 1) {
    throw std::invalid_argument(fmt::format("KV evaluation: document '{}' has {} tokens, fewer than context {} + "
                                            "continuation {} + 1",
                                            doc.source, doc.tokens.size(), o.context, o.continuation));
  }
  DocRun r;
  DecodeSession session(model, o.chunk_tokens, policy, o.chunk_pairs);
  const auto t0 = std::chrono::steady_clock::now();
  session.prefill(std::vector<int64_t>(doc.tokens.begin(), doc.tokens.begin() + o.context));
  r.prefill_s = seconds_since(t0);
  r.after_prefill = snapshot(session.cache());
  // Token C + i is decoded and its logits score token C + i + 1: the continuation's N queries are the ones
  // that predict, as in generation.
  double nats = 0;
  const KvCacheSpec& cs = session.cache().spec();
  const int64_t token_bytes = session.cache().entry_bytes() * cs.layers * cs.kv_heads;  // one token, every head
  double bytes_sum = 0;
  for (int64_t i = 0; i < o.continuation; ++i) {
    // The token attends to the cache as it is now (compressed at the schedule's last step) and to itself.
    const auto held = static_cast<double>(session.cache().bytes() + token_bytes);
    bytes_sum += held;
    r.kv_bytes_max = std::max(r.kv_bytes_max, held);
    const auto t = std::chrono::steady_clock::now();
    torch::Tensor logits = session.decode(doc.tokens[static_cast<size_t>(o.context + i)]);
    r.decode_s += seconds_since(t);
    const int64_t target = doc.tokens[static_cast<size_t>(o.context + i + 1)];
    nats -= torch::log_softmax(logits.to(torch::kFloat64), 0)[target].item<double>();
    r.correct += logits.argmax().item<int64_t>() == target;
  }
  if (!std::isfinite(nats)) {
    throw std::runtime_error(fmt::format("KV evaluation: non-finite log-probability on document '{}' (the model's "
                                         "logits are not finite)",
                                         doc.source));
  }
  r.bpb = nats / std::log(2.0) / static_cast<double>(o.continuation);
  r.kv_bytes = session.cache().bytes();
  r.kv_bytes_mean = bytes_sum / static_cast<double>(o.continuation);
  r.abstained = policy->abstained_heads();
  return r;
}

// Per layer, the mean over heads and queries of the attention error of `compressed` against `full` (each KV
// head with its group's queries).
std::vector<double> layer_errors(const std::vector<KvHeadView>& full, const std::vector<KvHeadView>& compressed,
                                 const RecordingFullCache& ref, int64_t layers, int64_t heads) {
  std::vector<double> out;
  for (int64_t l = 0; l < layers; ++l) {
    const torch::Tensor& q = ref.queries(l);  // [query_heads, N, head_dim]
    const int64_t g = q.size(0) / heads;
    double sum = 0;
    for (int64_t h = 0; h < heads; ++h) {
      const size_t i = static_cast<size_t>(l * heads + h);
      sum += kv_attention_rel_err(full[i], compressed[i], q.narrow(0, h * g, g).reshape({-1, q.size(2)}), ref.scale())
                 .mean()
                 .item<double>();
    }
    out.push_back(sum / static_cast<double>(heads));
  }
  return out;
}

// kv-eval's head ablation: right after the prefill of `context` tokens, cuts (layer, head) to its first
// kKvAblationSinks and newest kKvAblationRecent entries; every other head, and everything decoded later, is kept.
class HeadCut : public KvPolicy {
 public:
  HeadCut(int64_t layer, int64_t head, int64_t context) : layer_(layer), head_(head), context_(context) {}
  void after_step(KvCache& cache, const KvStep& step) override {
    if (!step.prefill || step.first_position + step.tokens != context_) return;
    const int64_t n = cache.view(layer_, head_).length();  // the context: > sinks + recent (validate)
    std::vector<KvHeadEdit> edits(static_cast<size_t>(cache.spec().kv_heads));
    edits[static_cast<size_t>(head_)].keep = torch::cat({torch::arange(kKvAblationSinks, torch::kInt64),
                                                          torch::arange(n - kKvAblationRecent, n, torch::kInt64)});
    cache.commit(layer_, edits);
  }

 private:
  int64_t layer_, head_, context_;
};

struct RowSamples {
  std::vector<double> bpb, bpb_full, accuracy, accuracy_full, exact, exact_full, rel, attn, kv_bytes, kv_bytes_full,
      kv_bytes_mean, kv_bytes_max, kv_bytes_full_mean, prefill, decode, abstained;
  std::vector<std::vector<double>> attn_layers;  // per document, [layers]
  std::vector<double> abstained_by_head;         // [layers x heads]: documents on which the head abstained
};

KvEvalRow summarize(const std::string& policy, double budget, const RowSamples& s, const KvEvalOptions& o,
                    const std::vector<int64_t>& clusters) {
  KvEvalRow row;
  row.policy = policy;
  row.budget = budget;
  row.documents = static_cast<int64_t>(s.rel.size());
  row.bpb = mean_of(s.bpb);
  row.bpb_full = mean_of(s.bpb_full);
  row.token_accuracy = mean_of(s.accuracy);
  row.token_accuracy_full = mean_of(s.accuracy_full);
  row.exact_match = mean_of(s.exact);
  row.exact_match_full = mean_of(s.exact_full);
  row.rel_bpb_increase = kv_eval_bootstrap(s.rel, clusters, o.bootstrap_resamples, o.seed);
  row.worst_decile_rel_increase = kv_quantile_with_ci(s.rel, 0.9);
  row.worst_decile_mean = worst_fraction_mean(s.rel, 0.1);
  row.rel_per_document = s.rel;
  row.attn_rel_err = kv_eval_bootstrap(s.attn, clusters, o.bootstrap_resamples, o.seed);
  const size_t layers = s.attn_layers.front().size();
  for (size_t l = 0; l < layers; ++l) {
    double sum = 0;
    for (const auto& d : s.attn_layers) sum += d[l];
    row.attn_rel_err_per_layer.push_back(sum / static_cast<double>(s.attn_layers.size()));
  }
  row.kv_bytes = mean_of(s.kv_bytes);
  row.kv_bytes_full = mean_of(s.kv_bytes_full);
  row.kv_bytes_mean = mean_of(s.kv_bytes_mean);
  row.kv_bytes_max = mean_of(s.kv_bytes_max);
  row.kv_bytes_full_mean = mean_of(s.kv_bytes_full_mean);
  row.prefill_s = mean_of(s.prefill);
  row.decode_s = mean_of(s.decode);
  row.abstained_heads = mean_of(s.abstained);
  for (double n : s.abstained_by_head) row.abstained_by_head.push_back(n / static_cast<double>(row.documents));
  return row;
}

}  // namespace

const char* kv_target_set_option(const KvPolicyOptions& options) {
  for (const char* key : {"budget", "max_tokens", "max_rel_error"}) {
    if (options.count(key) != 0) return key;
  }
  return nullptr;
}

std::shared_ptr<KvPolicy> kv_eval_target_policy(const KvEvalTarget& t) {
  KvPolicySpec spec = parse_kv_policy_spec(t.policy);
  if (const char* key = kv_target_set_option(spec.options)) {
    throw std::invalid_argument(fmt::format("KV evaluation: error-target policy '{}' sets {}; the target sets it", t.policy,
                                            key));
  }
  spec.options["max_rel_error"] = t.max_rel_error;
  return make_kv_policy(spec.name, spec.options);
}

void kv_check_calibration_policy(const KvEvalTarget& t, const std::string& path) {
  try {
    kv_eval_target_policy(t);
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(fmt::format("KV calibration '{}': field 'policy' ({}) does not make an error-target "
                                         "policy: {}",
                                         path, t.policy, e.what()));
  }
}

void KvEvalOptions::validate() const {
  if (policies.empty()) throw std::invalid_argument("KV evaluation: no policy given");
  if (budgets.empty()) throw std::invalid_argument("KV evaluation: no budget given");
  for (double b : budgets) {
    if (!(b > 0 && b <= 1)) throw std::invalid_argument(fmt::format("KV evaluation: budget {} outside (0, 1]", b));
  }
  const std::pair<const char*, int64_t> counts[] = {{"context", context},
                                                    {"continuation", continuation},
                                                    {"max_docs", max_docs},
                                                    {"chunk_tokens", chunk_tokens},
                                                    {"bootstrap_resamples", bootstrap_resamples}};
  for (const auto& [name, v] : counts) {
    if (v < 1) throw std::invalid_argument(fmt::format("KV evaluation: {} {} must be >= 1", name, v));
  }
  if (chunk_pairs < 0) throw std::invalid_argument(fmt::format("KV evaluation: chunk_pairs {} must be >= 0", chunk_pairs));
  if (head_ablation && context <= kKvAblationSinks + kKvAblationRecent) {
    throw std::invalid_argument(fmt::format("KV evaluation: head ablation keeps {} + {} entries per head: context {} must "
                                            "be longer for the cut to remove anything",
                                            kKvAblationSinks, kKvAblationRecent, context));
  }
  // A repeated row would only cost time; bad names and options fail before any document runs.
  if (const auto p = kv_first_repeat(policies); p != policies.end()) {
    throw std::invalid_argument(fmt::format("KV evaluation: policy '{}' is given twice", *p));
  }
  if (const auto b = kv_first_repeat(budgets); b != budgets.end()) {
    throw std::invalid_argument(fmt::format("KV evaluation: budget {} is given twice", *b));
  }
  for (const auto& p : policies) {
    for (double b : budgets) row_policy(p, b);
  }
  for (const auto& t : targets) {
    if (!(t.max_rel_bpb > 0) || !(t.max_rel_error > 0)) {
      throw std::invalid_argument(fmt::format("KV evaluation: error target {} with max_rel_error {}: both must be > 0",
                                              t.max_rel_bpb, t.max_rel_error));
    }
    kv_eval_target_policy(t);
  }
  if (!paired_against.empty() && std::find(policies.begin(), policies.end(), paired_against) == policies.end()) {
    throw std::invalid_argument(fmt::format("KV evaluation: paired_against '{}' is not among the policies", paired_against));
  }
}

std::vector<std::string> kv_source_files(const std::vector<KvEvalDocument>& documents) {
  std::vector<std::string> files;
  files.reserve(documents.size());
  for (const auto& d : documents) files.push_back(kv_source_file(d.source));
  std::sort(files.begin(), files.end());
  files.erase(std::unique(files.begin(), files.end()), files.end());
  return files;
}

std::string kv_source_file(const std::string& source) {
  const auto hash = source.rfind('#');
  const std::string file = hash == std::string::npos ? source : source.substr(0, hash);
  // The folder resolved (symlinks, "..", a relative spelling of --data.path), the file name kept as it is: a file
  // read through another spelling of its folder is the same source file, on the same side of the split, and a real
  // folder's names (the default corpus) are unchanged.
  const std::filesystem::path p(file);
  std::error_code ec;
  const std::filesystem::path dir =
      std::filesystem::weakly_canonical(p.has_parent_path() ? p.parent_path() : std::filesystem::path("."), ec);
  return ec ? file : (dir / p.filename()).string();
}

std::vector<int64_t> kv_eval_split(const Corpus& corpus, const std::vector<int64_t>& ids, const std::string& side) {
  if (side != "calibration" && side != "evaluation") {
    throw std::invalid_argument(fmt::format("KV evaluation: split '{}' is neither calibration nor evaluation", side));
  }
  const bool want_calibration = side == "calibration";
  std::vector<int64_t> out;
  for (int64_t id : ids) {
    const std::string file = kv_source_file(corpus.samples().at(static_cast<size_t>(id)).source);
    // A hash of its own (not the held-out one's residue), so the halves do not follow the held-out choice.
    const bool calibration = (fnv1a64("kv-calibration:" + file) >> 32) % 2 == 0;
    if (calibration == want_calibration) out.push_back(id);
  }
  return out;
}

KvEvalSource kv_eval_source(const DataConfig& data_config, const std::string& data_path, const std::string& half,
                            Corpus& corpus) {
  if (!half.empty() && half != "calibration" && half != "evaluation") {
    throw std::invalid_argument(fmt::format("KV evaluation: --split '{}' must be calibration or evaluation (or absent)", half));
  }
  DataConfig data = data_config;
  const bool own = data_path.empty();
  if (!own) {
    // Another path is read whole: its format detected, every sample (its split would say nothing about what the
    // model trained on).
    data.path = data_path;
    data.format = "auto";
    data.heldout_fraction = 0;
  }
  corpus = Corpus::load(data);
  KvEvalSource out;
  out.data_path = data.path;
  out.ids = own ? corpus.heldout_ids() : corpus.train_ids();
  out.split = own ? "heldout" : "all";
  if (!half.empty()) {
    out.ids = kv_eval_split(corpus, out.ids, half);
    out.split = half;
  }
  return out;
}

KvEvalDocuments choose_kv_eval_documents(const Corpus& corpus, const std::vector<int64_t>& ids,
                                         const KvEvalOptions& o) {
  o.validate();
  KvEvalDocuments out;
  out.available = static_cast<int64_t>(ids.size());
  out.required_tokens = o.context + o.continuation + 1;
  std::vector<int64_t> eligible;
  int64_t longest = 0;
  for (int64_t id : ids) {
    // A sample of n bytes is n + 1 tokens with its BOS.
    const int64_t tokens = corpus.samples().at(static_cast<size_t>(id)).length + 1;
    longest = std::max(longest, tokens);
    if (tokens >= out.required_tokens) eligible.push_back(id);
  }
  out.too_short = out.available - static_cast<int64_t>(eligible.size());
  if (eligible.empty()) {
    throw std::invalid_argument(fmt::format(
        "KV evaluation: none of the {} documents has the {} tokens needed (context {} + continuation {} + 1, BOS "
        "included); the longest has {} (documents are cut at the checkpoint's data.max_seq_len)",
        out.available, out.required_tokens, o.context, o.continuation, longest));
  }
  std::mt19937_64 rng(o.seed);
  std::shuffle(eligible.begin(), eligible.end(), rng);
  const size_t chosen = std::min(eligible.size(), static_cast<size_t>(o.max_docs));
  out.not_chosen = static_cast<int64_t>(eligible.size() - chosen);
  for (size_t i = 0; i < chosen; ++i) {
    const int64_t id = eligible[i];
    const std::string_view bytes = corpus.bytes(id);
    KvEvalDocument doc;
    doc.source = corpus.samples().at(static_cast<size_t>(id)).source;
    doc.tokens.reserve(bytes.size() + 1);
    doc.tokens.push_back(kBosToken);
    for (unsigned char c : bytes) doc.tokens.push_back(c);
    out.documents.push_back(std::move(doc));
  }
  return out;
}

KvEvalResult run_kv_eval(Transformer& model, const std::vector<KvEvalDocument>& documents,
                         const KvEvalOptions& o, const std::function<void(int64_t, int64_t)>& on_document) {
  o.validate();
  if (documents.empty()) throw std::invalid_argument("KV evaluation: no document to evaluate");
  model->eval();
  torch::NoGradGuard no_grad;
  const int64_t layers = model->cfg.n_layers, heads = model->cfg.kv_heads();

  KvEvalResult result;
  result.options = o;
  // samples[p][b]: per document what the run measured; `full` fills budget 0 and is copied to every budget.
  RowSamples empty;
  empty.abstained_by_head.assign(static_cast<size_t>(layers * heads), 0.0);
  std::vector<std::vector<RowSamples>> samples(o.policies.size(), std::vector<RowSamples>(o.budgets.size(), empty));
  std::vector<RowSamples> target_samples(o.targets.size(), empty);
  std::vector<double> ref_prefill, ref_decode;
  std::vector<RowSamples> ablation(o.head_ablation ? static_cast<size_t>(layers * heads) : 0);
  for (const auto& doc : documents) {
    auto recorder = std::make_shared<RecordingFullCache>(layers, o.continuation, o.context + o.continuation - 1);
    const DocRun ref = run_document(model, doc, o, recorder);
    ref_prefill.push_back(ref.prefill_s);
    ref_decode.push_back(ref.decode_s);
    // The recorded window must be exactly the continuation's queries (positions context .. context + N - 1).
    for (int64_t l = 0; l < layers; ++l) {
      const torch::Tensor& pos = recorder->positions(l);
      if (pos.numel() != o.continuation || pos[0].item<int64_t>() != o.context) {
        throw std::logic_error(fmt::format("KV evaluation: layer {} recorded {} queries from position {}, expected {} "
                                           "from {}",
                                           l, pos.numel(), pos.numel() ? pos[0].item<int64_t>() : -1,
                                           o.continuation, o.context));
      }
    }
    for (size_t i = 0; i < ablation.size(); ++i) {
      const auto l = static_cast<int64_t>(i) / heads, h = static_cast<int64_t>(i) % heads;
      const DocRun run = run_document(model, doc, o, std::make_shared<HeadCut>(l, h, o.context));
      ablation[i].accuracy.push_back(static_cast<double>(run.correct) / static_cast<double>(o.continuation));
      ablation[i].exact.push_back(run.correct == o.continuation ? 1.0 : 0.0);
      ablation[i].rel.push_back((run.bpb - ref.bpb) / ref.bpb);
    }
    auto record = [&](RowSamples& s, const DocRun& run) {
      s.bpb.push_back(run.bpb);
      s.bpb_full.push_back(ref.bpb);
      const auto n = static_cast<double>(o.continuation);
      s.accuracy.push_back(static_cast<double>(run.correct) / n);
      s.accuracy_full.push_back(static_cast<double>(ref.correct) / n);
      s.exact.push_back(run.correct == o.continuation ? 1.0 : 0.0);
      s.exact_full.push_back(ref.correct == o.continuation ? 1.0 : 0.0);
      s.rel.push_back((run.bpb - ref.bpb) / ref.bpb);
      s.attn_layers.push_back(layer_errors(ref.after_prefill, run.after_prefill, *recorder, layers, heads));
      s.attn.push_back(mean_of(s.attn_layers.back()));
      s.kv_bytes.push_back(static_cast<double>(run.kv_bytes));
      s.kv_bytes_full.push_back(static_cast<double>(ref.kv_bytes));
      s.kv_bytes_mean.push_back(run.kv_bytes_mean);
      s.kv_bytes_max.push_back(run.kv_bytes_max);
      s.kv_bytes_full_mean.push_back(ref.kv_bytes_mean);
      s.prefill.push_back(run.prefill_s);
      s.decode.push_back(run.decode_s);
      s.abstained.push_back(static_cast<double>(run.abstained.size()));
      for (const auto& [l, h] : run.abstained) s.abstained_by_head[static_cast<size_t>(l * heads + h)] += 1;
    };
    for (size_t p = 0; p < o.policies.size(); ++p) {
      const bool full = is_full(o.policies[p]);
      for (size_t b = 0; b < o.budgets.size(); ++b) {
        if (full && b > 0) continue;
        record(samples[p][b], run_document(model, doc, o, row_policy(o.policies[p], o.budgets[b])));
      }
    }
    for (size_t t = 0; t < o.targets.size(); ++t) {
      record(target_samples[t], run_document(model, doc, o, kv_eval_target_policy(o.targets[t])));
    }
    if (on_document) on_document(static_cast<int64_t>(ref_prefill.size()), static_cast<int64_t>(documents.size()));
  }
  // The bootstrap's clusters: documents cut from the same source file, numbered in order of first appearance (the
  // numbering the bootstrap's seeded draws have always used); each path resolved once.
  std::map<std::string, int64_t> cluster_of;
  std::vector<int64_t> clusters;
  clusters.reserve(documents.size());
  for (const auto& doc : documents) {
    result.sources.push_back(doc.source);
    const std::string file = kv_source_file(doc.source);
    clusters.push_back(cluster_of.emplace(file, static_cast<int64_t>(cluster_of.size())).first->second);
  }
  for (const auto& [file, id] : cluster_of) result.files.push_back(file);  // sorted: kv_source_files(documents)
  result.source_files = static_cast<int64_t>(result.files.size());
  for (size_t p = 0; p < o.policies.size(); ++p) {
    for (size_t b = 0; b < o.budgets.size(); ++b) {
      const bool full = is_full(o.policies[p]);
      result.rows.push_back(summarize(o.policies[p], o.budgets[b], samples[p][full ? 0 : b], o, clusters));
    }
  }
  for (size_t t = 0; t < o.targets.size(); ++t) {
    const KvEvalTarget& target = o.targets[t];
    KvEvalRow row = summarize(target.policy, 1.0, target_samples[t], o, clusters);
    row.target = target;
    double within = 0;
    for (double v : row.rel_per_document) within += v <= target.max_rel_bpb ? 1.0 : 0.0;
    row.within_target = within / static_cast<double>(row.rel_per_document.size());
    result.rows.push_back(std::move(row));
  }
  // Paired differences against the candidate at each budget (the same documents, so document-level noise
  // cancels), bootstrapped over source files like the rows.
  std::string candidate = o.paired_against;
  if (candidate.empty() && std::find(o.policies.begin(), o.policies.end(), "minimax") != o.policies.end()) {
    candidate = "minimax";
  }
  if (!candidate.empty()) {
    const size_t c = static_cast<size_t>(std::find(o.policies.begin(), o.policies.end(), candidate) - o.policies.begin());
    for (size_t b = 0; b < o.budgets.size(); ++b) {
      const RowSamples& cs = samples[c][b];
      for (size_t p = 0; p < o.policies.size(); ++p) {
        if (p == c || is_full(o.policies[p])) continue;
        const RowSamples& bs = samples[p][b];
        KvEvalPaired pair;
        pair.budget = o.budgets[b];
        pair.candidate = candidate;
        pair.baseline = o.policies[p];
        std::vector<double> diff;
        double wins = 0;
        for (size_t i = 0; i < cs.rel.size(); ++i) {
          diff.push_back(cs.rel[i] - bs.rel[i]);
          wins += diff.back() < 0 ? 1.0 : 0.0;
        }
        pair.documents = static_cast<int64_t>(diff.size());
        pair.diff = kv_eval_bootstrap(diff, clusters, o.bootstrap_resamples, o.seed);
        pair.wins = wins / static_cast<double>(diff.size());
        pair.bytes_ratio = mean_of(cs.kv_bytes_mean) / mean_of(bs.kv_bytes_mean);
        result.paired.push_back(pair);
      }
    }
  }
  for (size_t i = 0; i < ablation.size(); ++i) {
    result.head_ablation.push_back({static_cast<int64_t>(i) / heads, static_cast<int64_t>(i) % heads,
                                    mean_of(ablation[i].accuracy), mean_of(ablation[i].exact),
                                    mean_of(ablation[i].rel)});
  }
  result.full_prefill_s = mean_of(ref_prefill);
  result.full_decode_s = mean_of(ref_decode);
  return result;
}

}  // namespace dcp
