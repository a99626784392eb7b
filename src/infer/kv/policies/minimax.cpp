// minimax: causal merge-reduce of weighted block summaries, budgets shared across heads by predicted error,
// abstention on incompressible heads.
#include "infer/kv/policies/minimax.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <queue>
#include <stdexcept>

#include "infer/kv/summary.h"

namespace dcp {
namespace {

// Entries of a head whose positions lie in [start, end): their index range in the view (positions ascend).
std::pair<int64_t, int64_t> index_range(const torch::Tensor& positions, int64_t start, int64_t end) {
  const torch::Tensor bounds = torch::tensor({start, end}, torch::kInt64);
  const torch::Tensor at = torch::searchsorted(positions, bounds);
  return {at[0].item<int64_t>(), at[1].item<int64_t>()};
}

// A reproducible generator per (seed, layer, head, position): the same sequence compresses the same way.
at::Generator generator(uint64_t seed, int64_t layer, int64_t head, int64_t position) {
  uint64_t h = seed ^ 0x9e3779b97f4a7c15ULL;
  for (uint64_t x : {static_cast<uint64_t>(layer), static_cast<uint64_t>(head), static_cast<uint64_t>(position)}) {
    h = (h ^ x) * 0x100000001b3ULL;
  }
  return at::make_generator<at::CPUGeneratorImpl>(h);
}


// Reference queries of one head (spec 4.2): the observed ones, draws from a Gaussian fitted to them (the
// query-agnostic part, as Expected Attention's model of future queries; `z` [samples, head_dim] standard normal,
// undefined: none), and a needle probe per entry of `sample` (undefined: none), a future query that names that
// entry: the lookup case the estimate must see.
torch::Tensor reference_queries(const torch::Tensor& observed, const KvHeadView& view, const torch::Tensor& block,
                                const torch::Tensor& sample, const torch::Tensor& z) {
  std::vector<torch::Tensor> refs{observed};
  if (z.defined() && observed.size(0) >= 2) {
    const torch::Tensor mu = observed.mean(0);
    const torch::Tensor centred = (observed - mu).to(torch::kDouble);
    const int64_t d = observed.size(1);
    torch::Tensor sigma = torch::matmul(centred.t(), centred) / static_cast<double>(observed.size(0));
    sigma += torch::eye(d, torch::kDouble) * (1e-6 * sigma.diagonal().mean().item<double>() + 1e-12);
    refs.push_back((mu.to(torch::kDouble) + torch::matmul(z, torch::linalg_cholesky(sigma).t())).to(torch::kFloat));
  }
  if (sample.defined()) {
    // As sharp as the observed queries are on this block: along the entry's key, at their mean norm times their
    // mean best cosine with an entry of the block (~1 where queries name block entries, a lookup head; small
    // where they match nothing there in particular, e.g. attend to sinks or recent entries, so that a block of
    // random keys read by such queries is not called lookup).
    auto unit = [](const torch::Tensor& x) { return x / x.norm(2, 1, true).clamp_min(1e-30); };
    const torch::Tensor keys = unit(view.keys.index_select(0, block).to(torch::kFloat));
    const double cosine = torch::matmul(unit(observed), keys.t()).amax(1).clamp_min(0).mean().item<double>();
    const double norm = observed.norm(2, 1).mean().item<double>() * cosine;
    refs.push_back(unit(view.keys.index_select(0, sample).to(torch::kFloat)) * norm);
  }
  return torch::cat(refs);
}

}  // namespace

// One head's work in a layer's compression.
struct MinimaxKvPolicy::Work {
  int64_t head;
  KvHeadView view;
  torch::Tensor block;  // [n] indices into the view: the entries the summary replaces
  int64_t budget;       // its fair share: what the head may keep of the block
  std::unique_ptr<KvBlockSummary> summary;
  int64_t atoms = 0;    // allocated
  double tail = 0, heldout = 0;
};

MinimaxKvPolicy::MinimaxKvPolicy(const MinimaxOptions& o) : options_(o) {
  const KvBudget& b = o.budget;
  if (!(b.ratio > 0 && b.ratio <= 1) || b.interval < 1 || b.max_tokens < 0 || o.window < 1 || o.samples < 0 ||
      o.probes < 0 || o.n_sink < 0 || !(o.recent_fraction >= 0 && o.recent_fraction <= 1) ||
      !(o.alpha_safeguard >= 0 && o.alpha_safeguard <= 1) || !(o.abstain_tail >= 0) || !(o.abstain_heldout >= 0)) {
    throw std::invalid_argument(fmt::format(
        "MinimaxKvPolicy: budget {} must be in (0, 1], interval {} >= 1, max_tokens {} >= 0, window {} >= 1, "
        "samples {}, probes {}, n_sink {} >= 0, recent_fraction {} and alpha_safeguard {} in [0, 1], abstain_tail "
        "{} and abstain_heldout {} >= 0", b.ratio, b.interval, b.max_tokens, o.window, o.samples, o.probes, o.n_sink,
        o.recent_fraction, o.alpha_safeguard, o.abstain_tail, o.abstain_heldout));
  }
}

void MinimaxKvPolicy::reset() {
  state_.clear();
  risks_.clear();
  seen_.clear();
}

std::vector<std::pair<int64_t, int64_t>> MinimaxKvPolicy::abstained_heads() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t i = 0; i < static_cast<int64_t>(state_.size()); ++i) {
    if (state_[static_cast<size_t>(i)].abstained) out.emplace_back(i / heads_, i % heads_);
  }
  return out;
}

// Spec 4.4, restart: a new sequence (or a cache of another shape) without reset() starts over.
void MinimaxKvPolicy::restart_if_new(const KvCache& cache) {
  const int64_t layers = cache.spec().layers, heads = cache.spec().kv_heads;
  bool fresh = state_.empty() || layers != layers_ || heads != heads_;
  for (int64_t l = 0; !fresh && l < layers; ++l) fresh = cache.next_position(l) < seen_[static_cast<size_t>(l)];
  if (!fresh) return;
  layers_ = layers, heads_ = heads;
  state_.assign(static_cast<size_t>(layers * heads), HeadState{{}, options_.n_sink, false});
  risks_.assign(static_cast<size_t>(layers * heads), KvHeadRisk{});
  seen_.assign(static_cast<size_t>(layers), 0);
}

// Spec 4.4, collect blocks: per head of `layer`, the positions between the sinks and the recent window form
// segments merged like a binary counter (merge-reduce); the newest segment is the block to summarise, with the
// head's fair share of the budget. Heads that abstained, fit their budget or have nothing to summarise give none.
std::vector<MinimaxKvPolicy::Work> MinimaxKvPolicy::collect_blocks(const KvCache& cache, int64_t layer) {
  const int64_t heads = heads_, n = cache.next_position(layer);
  const int64_t total = options_.budget.per_head(cache, layer);
  const int64_t recent = static_cast<int64_t>(std::ceil(options_.recent_fraction * static_cast<double>(total)));
  const int64_t recent_start = std::max(n - recent, options_.n_sink);
  std::vector<Work> work;
  for (int64_t h = 0; h < heads; ++h) {
    HeadState& st = state_[static_cast<size_t>(layer * heads + h)];
    if (st.abstained || cache.length(layer, h) <= total) continue;
    if (recent_start > st.tree_end) {
      st.segments.push_back({st.tree_end, recent_start, 0});
      st.tree_end = recent_start;
    }
    if (st.segments.empty()) continue;  // only sinks and the recent window: all protected
    auto& seg = st.segments;
    // Merge-reduce (spec 4.4): two summaries of the same level become one of the next, like a binary counter.
    while (seg.size() >= 2 && seg[seg.size() - 1].level == seg[seg.size() - 2].level) {
      const Segment top = seg.back();
      seg.pop_back();
      seg.back() = {seg.back().start, top.end, top.level + 1};
    }
    const KvHeadView view = cache.view(layer, h);
    auto entries = [&](int64_t a, int64_t b) {
      const auto r = index_range(view.positions, a, b);
      return r.second - r.first;
    };
    const int64_t exact = entries(0, options_.n_sink) + entries(recent_start, n);
    int64_t older = entries(options_.n_sink, seg.back().start);
    // The summaries' share of the budget, by the span of positions each covers; older ones holding more than
    // theirs (a budget that stopped growing, max_tokens) are absorbed and summarised again with the new block.
    const int64_t room = std::max<int64_t>(total - exact, 0);
    const double span = static_cast<double>(st.tree_end - options_.n_sink);
    auto share = [&](const Segment& s) {
      return static_cast<int64_t>(std::floor(static_cast<double>(room) * static_cast<double>(s.end - s.start) / span));
    };
    while (seg.size() >= 2 && room - older < share(seg.back())) {
      const Segment top = seg.back();
      seg.pop_back();
      seg.back() = {seg.back().start, top.end, std::max(seg.back().level, top.level)};
      older = entries(options_.n_sink, seg.back().start);
    }
    const auto [first, last] = index_range(view.positions, seg.back().start, seg.back().end);
    if (last == first) continue;
    Work w{h, view, torch::arange(first, last, torch::kInt64), std::clamp<int64_t>(room - older, 0, last - first)};
    if (w.budget >= last - first) continue;  // the block fits whole: nothing to summarise
    work.push_back(std::move(w));
  }
  return work;
}

// Spec section 2 and 4.3, assess a head: its reference queries, the compressibility estimate (the spectral tail
// of sampled entries), the held-out risk; a head judged incompressible gets no summary (it abstains), the others
// the greedy path of their block's summary. `position` seeds the head's draws.
void MinimaxKvPolicy::assess_head(Work& w, const torch::Tensor& observed, double scale, int64_t layer,
                                  int64_t position) const {
  at::Generator gen = generator(options_.seed, layer, w.head, position);
  torch::Tensor z, sample;  // Gaussian draws, then probed entries (this order keeps earlier results' draws)
  if (options_.samples > 0 && observed.size(0) >= 2) {
    z = at::randn({options_.samples, observed.size(1)}, gen, torch::TensorOptions().dtype(torch::kDouble));
  }
  const int64_t nb = w.block.numel();
  const int64_t probes = std::min(options_.probes, nb);
  if (probes > 0) {
    sample = w.block.index_select(0, at::randperm(nb, gen, torch::TensorOptions().dtype(torch::kInt64)).narrow(0, 0, probes));
  }
  const torch::Tensor queries = reference_queries(observed, w.view, w.block, sample, z);
  if (probes > 0) {
    // Compressibility (spec section 2): the spectral tail of the sampled entries' response Gram at the
    // budget's share of the sample.
    const torch::Tensor p = kv_head_probs(w.view, queries, scale);
    const auto keep = static_cast<int64_t>(std::ceil(static_cast<double>(w.budget) * static_cast<double>(probes) / static_cast<double>(nb)));
    // Weighted by the attention share the observed queries give the block: a block the head hardly reads
    // (its mass on sinks or recent entries) risks little however flat its spectrum.
    const double share = p.narrow(0, 0, observed.size(0)).index_select(1, w.block).sum(1).mean().item<double>();
    w.tail = share * kv_spectral_tail(p.index_select(1, sample), w.view.values.index_select(0, sample),
                                      std::min(keep, probes));
  }
  // Held-out risk: a summary of the head's budget fitted without half of the observed queries, its relative
  // output error on that half. Future queries are not the reference ones, and a summary judged on the
  // queries it was fitted to looks better than it is.
  if (options_.abstain_heldout > 0 && observed.size(0) >= 2) {
    const torch::Tensor order = at::randperm(observed.size(0), gen, torch::TensorOptions().dtype(torch::kInt64));
    const int64_t held = observed.size(0) / 2;
    const torch::Tensor fit_queries = reference_queries(
        observed.index_select(0, order.narrow(0, held, observed.size(0) - held)), w.view, w.block, sample, z);
    KvBlockSummary check(w.view, fit_queries, scale, w.block);
    check.extend(w.budget);
    const auto atoms = std::min<int64_t>(w.budget, static_cast<int64_t>(check.order().size()));
    const KvBlockSummary::Fit fit = atoms > 0 ? check.fit(atoms, false)
                                              : KvBlockSummary::Fit{torch::zeros({0}, torch::kInt64),
                                                                    torch::zeros({0})};  // evict the block
    w.heldout = kv_heldout_rel_error(w.view, observed.index_select(0, order.narrow(0, 0, held)), scale, w.block,
                                     fit.atoms, fit.log_weight);
  }
  if (w.tail > options_.abstain_tail || (options_.abstain_heldout > 0 && w.heldout > options_.abstain_heldout)) {
    return;
  }
  w.summary = std::make_unique<KvBlockSummary>(w.view, queries, scale, w.block);
  // The path may give a head up to twice its share (plus a little): what the allocation can move to it.
  w.summary->extend(std::min(nb, 2 * w.budget + 16));
}

// Spec 4.6, allocate the budget across heads: each head its floor (alpha_safeguard of its share), then the pool
// atom by atom to the head whose predicted error drops most.
void MinimaxKvPolicy::allocate_budget(std::vector<Work>& work) const {
  int64_t pool = 0;
  using Gain = std::pair<double, size_t>;
  std::priority_queue<Gain> next;
  auto gain = [&](const Work& w) {
    return w.summary->error()[static_cast<size_t>(w.atoms)] - w.summary->error()[static_cast<size_t>(w.atoms) + 1];
  };
  for (size_t i = 0; i < work.size(); ++i) {
    Work& w = work[i];
    if (!w.summary) continue;
    pool += w.budget;
    const auto path = static_cast<int64_t>(w.summary->order().size());
    w.atoms = std::min(path, static_cast<int64_t>(std::floor(options_.alpha_safeguard * static_cast<double>(w.budget))));
    pool -= w.atoms;
    if (w.atoms < path) next.emplace(gain(w), i);
  }
  while (pool > 0 && !next.empty()) {
    const size_t i = next.top().second;
    next.pop();
    Work& w = work[i];
    ++w.atoms;
    --pool;
    if (w.atoms < static_cast<int64_t>(w.summary->order().size())) next.emplace(gain(w), i);
  }
}

// Spec 4.3 step 4 and 8, commit: each head's fitted atoms with their log-weights (and refitted values) replace its
// block, an abstaining head is kept whole from now on; one KvCache::commit for the layer.
void MinimaxKvPolicy::commit_layer(KvCache& cache, int64_t layer, std::vector<Work>& work) {
  std::vector<KvHeadEdit> edits(static_cast<size_t>(heads_));
  bool any = false;
  for (Work& w : work) {
    HeadState& st = state_[static_cast<size_t>(layer * heads_ + w.head)];
    KvHeadRisk& risk = risks_[static_cast<size_t>(layer * heads_ + w.head)];
    risk.tail = w.tail;
    risk.heldout = w.heldout;
    if (!w.summary) {
      st.abstained = true;
      risk.abstained = true;
      risk.error = 0;
      risk.kept = w.view.length();
      continue;
    }
    const int64_t n_view = w.view.length();
    torch::Tensor mask = torch::ones({n_view}, torch::kBool);
    mask.index_fill_(0, w.block, false);
    torch::Tensor bias = w.view.bias.clone();
    torch::Tensor values;
    KvBlockSummary::Fit fit;
    if (w.atoms > 0) {
      fit = w.summary->fit(w.atoms, options_.refit_values);
      const torch::Tensor kept = w.block.index_select(0, fit.atoms);
      mask.index_fill_(0, kept, true);
      bias.index_add_(0, kept, fit.log_weight);
      if (fit.values.defined()) {
        values = w.view.values.to(torch::kFloat).clone();
        values.index_copy_(0, kept, fit.values);
      }
    } else {
      fit.error = w.summary->error()[0];
    }
    KvHeadEdit& e = edits[static_cast<size_t>(w.head)];
    e.keep = mask.nonzero().flatten();
    e.new_bias = bias.index_select(0, e.keep);
    if (values.defined()) e.new_values = values.index_select(0, e.keep);
    risk.error = std::sqrt(fit.error);
    risk.kept = e.keep.numel();
    any = true;
  }
  if (any) cache.commit(layer, edits);
}

void MinimaxKvPolicy::after_step(KvCache& cache, const KvStep& step) {
  if (!options_.budget.due(step)) return;
  const KvObservations* obs = step.observations;
  torch::NoGradGuard no_grad;
  restart_if_new(cache);
  for (int64_t layer = 0; layer < layers_; ++layer) {
    const int64_t n = cache.next_position(layer);
    seen_[static_cast<size_t>(layer)] = n;
    std::vector<Work> work = collect_blocks(cache, layer);
    if (work.empty()) continue;
    if (obs == nullptr || !obs->window_queries(layer).defined()) {
      throw std::invalid_argument(
          fmt::format("MinimaxKvPolicy: layer {}: no observed queries (needs window {})", layer, options_.window));
    }
    for (Work& w : work) assess_head(w, obs->window_queries(layer).select(0, w.head), obs->scale(), layer, n);
    allocate_budget(work);
    commit_layer(cache, layer, work);
  }
}

}  // namespace dcp
