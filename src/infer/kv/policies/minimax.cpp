// minimax: causal merge-reduce of weighted block summaries, one pool per layer shared by predicted error,
// per-block abstention on incompressible blocks, error targets.
#include "infer/kv/policies/minimax.h"

#include <ATen/Parallel.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <queue>
#include <stdexcept>

#include "infer/kv/summary.h"
#include "util/hash.h"
#include "util/omp_for_each.h"

namespace dcp {
namespace {

// While alive, the library calls (ATen, OpenBLAS) of this thread, and of the threads of parallel regions it opens,
// run on their calling thread alone: a layer's compression then computes the same bits on any number of threads
// (ATen splits its reductions, and BLAS its matrix-vector products, by thread count), its heads spread over the
// threads by for_each_head instead. omp_set_num_threads governs ATen and an OpenMP build of OpenBLAS (Debian's
// libopenblas0-openmp, which libtorch uses here); a pthreads OpenBLAS or MKL would need their own thread setting
// (KvMinimax.LongPathsAreTheSameBitsOnAnyThreadCount fails if the BLAS splits a product over threads).
struct LibraryCallsOnOneThread {
  int restore;
  LibraryCallsOnOneThread() : restore(at::get_num_threads()) {
#ifdef _OPENMP
    omp_set_num_threads(1);
#endif
  }
  ~LibraryCallsOnOneThread() {
#ifdef _OPENMP
    omp_set_num_threads(restore);
#endif
  }
  LibraryCallsOnOneThread(const LibraryCallsOnOneThread&) = delete;
  LibraryCallsOnOneThread& operator=(const LibraryCallsOnOneThread&) = delete;
};

// Runs body(i) for i in [0, count): one index at a time to whichever of `threads` threads is free (this file is
// compiled with OpenMP, CMakeLists.txt), or in order on the calling thread for one thread or one index. The heads of
// a layer are independent (each reads the cache and the observations, draws from its own generator and writes only
// its own Work), and under LibraryCallsOnOneThread each head's calls run as they would alone, so the result does not
// depend on `threads`. The first exception an index throws is rethrown once all stopped.
template <class Body>
void for_each_head(int threads, size_t count, const Body& body) {
  const bool ran = omp_for_each(static_cast<int64_t>(count), threads, [&](int64_t i) {
    torch::NoGradGuard no_grad;  // grad mode is per thread
    body(static_cast<size_t>(i));
  });
  if (ran) return;
  for (size_t i = 0; i < count; ++i) body(i);
}

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
    h = (h ^ x) * Fnv1a64::kPrime;  // FNV-1a's step over whole words, not bytes
  }
  return at::make_generator<at::CPUGeneratorImpl>(h);
}

// Newest entries kept exact: with an error target, recent_tokens (kMinimaxTargetRecentTokens when 0); else at least recent_tokens and
// recent_fraction of the head's budget, that share at most what the budget leaves beside the sinks (so a
// recent_fraction near 1 does not keep n_sink entries over the budget; recent_tokens may, as documented).
int64_t recent_entries(const MinimaxOptions& o, int64_t per_head) {
  if (o.max_rel_error > 0) return o.recent_tokens > 0 ? o.recent_tokens : kMinimaxTargetRecentTokens;
  const auto share = static_cast<int64_t>(std::ceil(o.recent_fraction * static_cast<double>(per_head)));
  return std::max(o.recent_tokens, std::min(share, std::max<int64_t>(0, per_head - o.n_sink)));
}

// The reference queries of one KV head (spec 4.2) with the positions they see up to.
struct References {
  torch::Tensor queries;    // [Q, head_dim] fp32
  torch::Tensor positions;  // [Q] int64: an observed query its own position, the others kKvFutureQuery
  int64_t observed = 0;     // the first `observed` rows are the observed queries
};

// observed [g, w, d]: the last w queries of each query head of the group, at observed_positions [w]. Then, per
// query head, draws from a Gaussian fitted to its queries (the query-agnostic part, as Expected Attention's
// model of future queries; z[j] [s, d] standard normal, empty: none), and a needle probe per entry of `sample`
// (undefined: none), a future query that names that entry: the lookup case the estimate must see.
References reference_queries(const torch::Tensor& observed, const torch::Tensor& observed_positions,
                             const KvHeadView& view, const torch::Tensor& block, const torch::Tensor& sample,
                             const std::vector<torch::Tensor>& z) {
  const int64_t g = observed.size(0), w = observed.size(1), d = observed.size(2);
  const torch::Tensor flat = observed.reshape({g * w, d});
  References r;
  r.observed = g * w;
  std::vector<torch::Tensor> refs{flat};
  if (!z.empty() && w >= 2) {
    for (int64_t j = 0; j < g; ++j) {
      const torch::Tensor oj = observed[j];
      const torch::Tensor mu = oj.mean(0);
      const torch::Tensor centred = (oj - mu).to(torch::kDouble);
      torch::Tensor sigma = torch::matmul(centred.t(), centred) / static_cast<double>(w);
      sigma += torch::eye(d, torch::kDouble) * (1e-6 * sigma.diagonal().mean().item<double>() + 1e-12);
      refs.push_back((mu.to(torch::kDouble) + torch::matmul(z[static_cast<size_t>(j)], torch::linalg_cholesky(sigma).t()))
                         .to(torch::kFloat));
    }
  }
  if (sample.defined()) {
    // As sharp as the observed queries are on this block: along the entry's key, at their mean norm times their
    // mean best cosine with an entry of the block (~1 where queries name block entries, a lookup head; small
    // where they match nothing there in particular, e.g. attend to sinks or recent entries, so that a block of
    // random keys read by such queries is not called lookup).
    auto unit = [](const torch::Tensor& x) { return x / x.norm(2, 1, true).clamp_min(1e-30); };
    const torch::Tensor keys = unit(view.keys.index_select(0, block).to(torch::kFloat));
    const double cosine = torch::matmul(unit(flat), keys.t()).amax(1).clamp_min(0).mean().item<double>();
    const double norm = flat.norm(2, 1).mean().item<double>() * cosine;
    refs.push_back(unit(view.keys.index_select(0, sample).to(torch::kFloat)) * norm);
  }
  r.queries = torch::cat(refs);
  r.positions = torch::cat({observed_positions.to(torch::kInt64).repeat({g}),
                            torch::full({r.queries.size(0) - r.observed}, kKvFutureQuery, torch::kInt64)});
  return r;
}

}  // namespace

// One head's work in a layer's compression.
struct MinimaxKvPolicy::Work {
  int64_t head;
  KvHeadView view;
  torch::Tensor block;  // [n] indices into the view: the entries the summary replaces
  int64_t budget;       // its fair share: what the head may keep of the block at a uniform split
  int64_t screened = 0; // entries screened out of the block before its summary, kept exact (max_keep_fraction)
  double scale = 0;
  References refs;
  torch::Tensor probs;  // [Q, view length] fp32 attention of the reference queries, once the estimate or screening
                        // computed it (ensure_probs); freed when the summary is built
  std::unique_ptr<KvBlockSummary> summary;
  int64_t atoms = 0;    // allocated
  bool flagged = false; // judged incompressible (an abstention)
  bool exact = false;   // kept whole
  double tail = 0, heldout = 0;
  std::optional<KvBlockSummary::Fit> fitted;  // the weights of `atoms` entries, once computed

  int64_t size() const { return block.numel(); }
  // The reference queries' attention over the head (fp32): the estimate's when it computed them, else now.
  const torch::Tensor& ensure_probs() {
    if (!probs.defined()) probs = kv_head_probs(view, refs.queries, scale, refs.positions, torch::kFloat);
    return probs;
  }
  KvBlockSummary& ensure_summary() {
    if (!summary) {
      // The estimate's probabilities are the summary's (same queries, positions, scale and dtype): computed once.
      summary = std::make_unique<KvBlockSummary>(view, ensure_probs(), block);
      probs = torch::Tensor();
    }
    return *summary;
  }
  // Whether the path reaches beyond `atoms`, extending it by one entry when it does not yet: the path is exactly
  // as long as the allocation reads (its error curve one entry past the atoms given).
  bool can_grow() {
    KvBlockSummary& s = ensure_summary();
    if (atoms < static_cast<int64_t>(s.order().size())) return true;
    if (s.exhausted()) return false;
    s.extend(atoms + 1);
    return atoms < static_cast<int64_t>(s.order().size());
  }
  double gain() const {
    const auto& e = summary->error();
    return e[static_cast<size_t>(atoms)] - e[static_cast<size_t>(atoms) + 1];
  }
};

MinimaxKvPolicy::MinimaxKvPolicy(const MinimaxOptions& o) : options_(o) {
  const KvBudget& b = o.budget;
  // An error target with a budget is a conflict between valid values: its own message, the reason first
  // (max_keep_fraction below 1 with an error target is refused by make_kv_policy).
  if (o.max_rel_error > 0 && (b.ratio < 1 || b.max_tokens > 0)) {
    throw std::invalid_argument(fmt::format(
        "MinimaxKvPolicy: an error target (max_rel_error {}) sizes the cache itself and needs budget 1 and "
        "max_tokens 0; got budget {} and max_tokens {}",
        o.max_rel_error, b.ratio, b.max_tokens));
  }
  if (!(b.ratio > 0 && b.ratio <= 1) || b.interval < 1 || b.max_tokens < 0 || o.window < 1 || o.samples < 0 ||
      o.probes < 0 || o.n_sink < 0 || o.recent_tokens < 0 || !(o.recent_fraction >= 0 && o.recent_fraction <= 1) ||
      !(o.alpha_safeguard >= 0 && o.alpha_safeguard <= 1) || !(o.abstain_tail >= 0) || !(o.abstain_heldout >= 0) ||
      !(o.max_rel_error >= 0) || !(o.max_keep_fraction > 0 && o.max_keep_fraction <= 1)) {
    throw std::invalid_argument(fmt::format(
        "MinimaxKvPolicy: budget {} must be in (0, 1], interval {} >= 1, max_tokens {} >= 0, window {} >= 1, "
        "samples {}, probes {}, n_sink {}, recent_tokens {} >= 0, recent_fraction {} and alpha_safeguard {} in [0, 1], "
        "abstain_tail {}, abstain_heldout {} and max_rel_error {} >= 0, max_keep_fraction {} in (0, 1]",
        b.ratio, b.interval, b.max_tokens, o.window, o.samples, o.probes, o.n_sink, o.recent_tokens, o.recent_fraction,
        o.alpha_safeguard, o.abstain_tail, o.abstain_heldout, o.max_rel_error, o.max_keep_fraction));
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
    if (state_[static_cast<size_t>(i)].abstentions > 0) out.emplace_back(i / heads_, i % heads_);
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
  state_.assign(static_cast<size_t>(layers * heads), HeadState{{}, options_.n_sink, 0});
  risks_.assign(static_cast<size_t>(layers * heads), KvHeadRisk{});
  seen_.assign(static_cast<size_t>(layers), 0);
}

// Spec 4.4, collect blocks: per head of `layer`, the positions between the sinks and the recent window form
// segments merged like a binary counter (merge-reduce); the newest segment is the block to summarise, with the
// head's fair share of the budget. Heads that fit their budget or have nothing to summarise give none. `pool`
// is set to the layer's capacity (kv_heads x the per-head budget) less everything the heads hold outside their
// blocks: what the blocks may keep together. With an error target only the new entries form a block.
std::vector<MinimaxKvPolicy::Work> MinimaxKvPolicy::collect_blocks(const KvCache& cache, int64_t layer,
                                                                   int64_t& pool) {
  const int64_t heads = heads_, n = cache.next_position(layer);
  const bool target = options_.max_rel_error > 0;
  const int64_t total = options_.budget.per_head(cache, layer);
  const int64_t recent_start = std::max(n - recent_entries(options_, total), options_.n_sink);
  int64_t held_outside = 0;
  std::vector<Work> work;
  for (int64_t h = 0; h < heads; ++h) {
    HeadState& st = state_[static_cast<size_t>(layer * heads + h)];
    const int64_t length = cache.length(layer, h);
    if (!target && length <= total) {
      held_outside += length;
      continue;
    }
    bool fresh = false;
    if (recent_start > st.tree_end) {
      st.segments.push_back({st.tree_end, recent_start, 0});
      st.tree_end = recent_start;
      fresh = true;
    }
    if (st.segments.empty() || (target && !fresh)) {  // only sinks and the recent window: all protected
      held_outside += length;
      continue;
    }
    auto& seg = st.segments;
    const KvHeadView view = cache.view(layer, h);
    auto entries = [&](int64_t a, int64_t b) {
      const auto r = index_range(view.positions, a, b);
      return r.second - r.first;
    };
    int64_t share = 0;
    if (!target) {
      // Merge-reduce (spec 4.4): two summaries of the same level become one of the next, like a binary counter.
      while (options_.merge && seg.size() >= 2 && seg[seg.size() - 1].level == seg[seg.size() - 2].level) {
        const Segment top = seg.back();
        seg.pop_back();
        seg.back() = {seg.back().start, top.end, top.level + 1};
      }
      const int64_t exact = entries(0, options_.n_sink) + entries(recent_start, n);
      int64_t older = entries(options_.n_sink, seg.back().start);
      // The summaries' share of the budget, by the span of positions each covers; older ones holding more than
      // theirs (a budget that stopped growing, max_tokens, or a head that took from the pool) are absorbed and
      // summarised again with the new block.
      const int64_t room = std::max<int64_t>(total - exact, 0);
      const double span = static_cast<double>(st.tree_end - options_.n_sink);
      auto share_of = [&](const Segment& s) {
        return static_cast<int64_t>(std::floor(static_cast<double>(room) * static_cast<double>(s.end - s.start) / span));
      };
      while (seg.size() >= 2 && room - older < share_of(seg.back())) {
        const Segment top = seg.back();
        seg.pop_back();
        seg.back() = {seg.back().start, top.end, std::max(seg.back().level, top.level)};
        older = entries(options_.n_sink, seg.back().start);
      }
      share = room - older;
    }
    const auto [first, last] = index_range(view.positions, seg.back().start, seg.back().end);
    if (target) share = last - first;
    if (last == first || (!target && std::clamp<int64_t>(share, 0, last - first) >= last - first)) {
      held_outside += length;  // the block fits whole: nothing to summarise
      continue;
    }
    held_outside += length - (last - first);
    Work w{h, view, torch::arange(first, last, torch::kInt64), std::clamp<int64_t>(share, 0, last - first)};
    work.push_back(std::move(w));
  }
  pool = heads * total - held_outside;
  return work;
}

// Spec section 2 and 4.3, assess a head: its reference queries, the compressibility estimate (the spectral tail
// of sampled entries), the held-out risk; a block judged incompressible is flagged (an abstention), the others
// get their summary now (the allocation reads their error curves). `position` seeds the head's draws.
void MinimaxKvPolicy::assess_head(Work& w, const KvObservations& obs, int64_t layer, int64_t position) const {
  at::Generator gen = generator(options_.seed, layer, w.head, position);
  const int64_t g = obs.group();
  const torch::Tensor observed = obs.window_queries(layer).narrow(0, w.head * g, g);  // [g, W, d]
  const torch::Tensor observed_positions = obs.window_positions(layer);
  w.scale = obs.scale();
  const int64_t W = observed.size(1), d = observed.size(2);
  std::vector<torch::Tensor> z;  // Gaussian draws per query head, then probed entries (this order keeps draws)
  if (options_.samples > 0 && W >= 2) {
    const int64_t each = (options_.samples + g - 1) / g;
    for (int64_t j = 0; j < g; ++j) z.push_back(at::randn({each, d}, gen, torch::TensorOptions().dtype(torch::kDouble)));
  }
  const int64_t nb = w.size();
  const int64_t probes = std::min(options_.probes, nb);
  torch::Tensor sample;
  if (probes > 0) {
    sample = w.block.index_select(0, at::randperm(nb, gen, torch::TensorOptions().dtype(torch::kInt64)).narrow(0, 0, probes));
  }
  w.refs = reference_queries(observed, observed_positions, w.view, w.block, sample, z);
  if (probes > 0) {
    // Compressibility (spec section 2): the spectral tail of the sampled entries' response Gram at the
    // budget's share of the sample.
    const torch::Tensor p = kv_head_probs(w.view, w.refs.queries, w.scale, w.refs.positions, torch::kFloat);
    w.probs = p;
    const auto keep = static_cast<int64_t>(
        std::ceil(static_cast<double>(w.budget) * static_cast<double>(probes) / static_cast<double>(nb)));
    // Weighted by the attention share the observed queries give the block: a block the head hardly reads
    // (its mass on sinks or recent entries) risks little however flat its spectrum.
    const double share = p.narrow(0, 0, w.refs.observed).index_select(1, w.block).sum(1).mean().item<double>();
    w.tail = share * kv_spectral_tail(p.index_select(1, sample), w.view.values.index_select(0, sample),
                                      std::min(keep, probes));
  }
  // Held-out risk: a summary of the head's share fitted without half of the observed positions, its relative
  // output error on that half. Future queries are not the reference ones, and a summary judged on the queries
  // it was fitted to looks better than it is.
  if (options_.abstain_heldout > 0 && W >= 2) {
    const torch::Tensor order = at::randperm(W, gen, torch::TensorOptions().dtype(torch::kInt64));
    const int64_t held = W / 2;
    const torch::Tensor fit_idx = order.narrow(0, held, W - held), held_idx = order.narrow(0, 0, held);
    const References fit_refs = reference_queries(observed.index_select(1, fit_idx),
                                                  observed_positions.index_select(0, fit_idx), w.view, w.block,
                                                  sample, z);
    KvBlockSummary check(w.view, fit_refs.queries, w.scale, w.block, fit_refs.positions);
    check.extend(w.budget);
    const auto atoms = std::min<int64_t>(w.budget, static_cast<int64_t>(check.order().size()));
    const KvBlockSummary::Fit fit = atoms > 0 ? check.fit(atoms, false)
                                              : KvBlockSummary::Fit{torch::zeros({0}, torch::kInt64),
                                                                    torch::zeros({0})};  // evict the block
    w.heldout = kv_heldout_rel_error(w.view, observed.index_select(1, held_idx).reshape({-1, d}), w.scale, w.block,
                                     fit.atoms, fit.log_weight,
                                     observed_positions.index_select(0, held_idx).repeat({g}));
  }
  w.flagged = w.tail > options_.abstain_tail || (options_.abstain_heldout > 0 && w.heldout > options_.abstain_heldout);
}

// Screening (MinimaxOptions::max_keep_fraction): where the head's share of its block is more than the fraction f
// of the block, its k = ceil((share - f n) / (1 - f)) entries of largest G_ii (mean_q p_qi^2 (||v_i - o_q||^2 +
// gamma^2), KvBlockSummary's diagonal: the first-order error of evicting entry i alone) stay exact, outside the
// block, and the rest is summarised with share - k entries (at most f of it at the fair share; the allocation may
// still give the head more). The entries kept exact contribute no first-order error, so the summary of the rest is
// a summary of a smaller block (its gamma^2, the mass-weighted mean distance, is then that of the rest). The
// screened entries leave the layer's pool before the allocation, as the exact parts outside the blocks (sinks,
// recent window) do, and count towards the head's floor (allocate_budget); `cap` bounds k (the head's floor when
// the layer has an incompressible block to serve from the pool, so that screening takes nothing it would get).
void MinimaxKvPolicy::screen_block(Work& w, int64_t cap) const {
  const int64_t n = w.size();
  const double f = options_.max_keep_fraction;
  if (static_cast<double>(w.budget) <= f * static_cast<double>(n)) return;
  const auto k = std::min<int64_t>({w.budget, cap, static_cast<int64_t>(std::ceil(
                                                       (static_cast<double>(w.budget) - f * static_cast<double>(n)) /
                                                       (1 - f)))});
  if (k <= 0 || k >= n) return;
  const KvBlockResponse r(w.view, w.ensure_probs(), w.block);
  // Q x G_ii, entry by entry
  const torch::Tensor diag = ((r.probs * r.probs) * (r.dist2 + r.gamma2)).sum(0).to(torch::kDouble).contiguous();
  const double* d = diag.data_ptr<double>();
  std::vector<int64_t> rank(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) rank[static_cast<size_t>(i)] = i;
  // Largest first, the older entry first on ties: the same choice on any thread count.
  std::partial_sort(rank.begin(), rank.begin() + k, rank.end(), [&](int64_t a, int64_t b) {
    return d[a] > d[b] || (d[a] == d[b] && a < b);
  });
  std::vector<char> exact(static_cast<size_t>(n), 0);
  for (int64_t j = 0; j < k; ++j) exact[static_cast<size_t>(rank[static_cast<size_t>(j)])] = 1;
  const int64_t* b = w.block.data_ptr<int64_t>();
  std::vector<int64_t> rest;
  rest.reserve(static_cast<size_t>(n - k));
  for (int64_t i = 0; i < n; ++i) {
    if (!exact[static_cast<size_t>(i)]) rest.push_back(b[i]);
  }
  w.block = torch::tensor(rest, torch::kInt64);
  w.budget -= k;
  w.screened = k;
}

// Spec 4.6, allocate the layer's pool across its heads' blocks: with an error target, each block the fewest
// atoms that meet it. Else each head its floor (alpha_safeguard of its share), then the incompressible blocks
// as much as the pool holds (whole when it can: kept exact; with exceed_budget whole and outside the pool), then
// the rest atom by atom to the head whose predicted error drops most; greedy paths grow only as far as the
// allocation reaches.
void MinimaxKvPolicy::allocate_budget(std::vector<Work>& work, int64_t pool, int threads) const {
  if (options_.max_rel_error > 0) {
    // Each block on its own: one head per thread.
    for_each_head(threads, work.size(), [&](size_t i) {
      Work& w = work[i];
      if (w.flagged) {
        w.exact = true;
        return;
      }
      KvBlockSummary& s = w.ensure_summary();
      // The fewest atoms whose relative error meets the target: by the path's least-squares weights, then
      // checked with the non-negative fit that is committed (it can err a little more), adding atoms until it
      // meets the target too.
      while (s.relative_error(w.atoms) > options_.max_rel_error && w.can_grow()) ++w.atoms;
      const double target2 = options_.max_rel_error * options_.max_rel_error * s.output_energy();
      while (w.atoms > 0) {
        w.fitted = s.fit(w.atoms, options_.refit_values);
        if (w.fitted->error <= target2 || !w.can_grow()) break;
        ++w.atoms;
      }
      if (w.atoms == w.size()) w.exact = true;
    });
    return;
  }
  pool = std::max<int64_t>(pool, 0);
  if (options_.exceed_budget) {
    // Kept whole outside the pool: the block's fair share leaves the pool with it, so the other heads keep
    // theirs (and the layer exceeds its budget by what the block holds beyond its share).
    for (Work& w : work) {
      if (!w.flagged) continue;
      w.exact = true;
      pool -= w.budget;
    }
    pool = std::max<int64_t>(pool, 0);
  }
  // The greedy paths first grown in parallel to one entry past each head's fair share (about where the allocation
  // below ends for most heads; a path is the same whether grown in one call or several, so this changes no result,
  // only which thread computes it), then on demand.
  for_each_head(threads, work.size(), [&](size_t i) {
    if (!work[i].flagged) work[i].summary->extend(work[i].budget + 1);
  });
  std::vector<size_t> flagged;
  for (size_t i = 0; i < work.size(); ++i) {
    Work& w = work[i];
    if (w.flagged) {
      if (!options_.exceed_budget) flagged.push_back(i);
      continue;
    }
    // The head's floor counts its screened entries (kept exact, already out of the pool).
    const auto floor = std::max<int64_t>(
        static_cast<int64_t>(std::floor(options_.alpha_safeguard * static_cast<double>(w.budget + w.screened))) -
            w.screened,
        0);
    w.summary->extend(floor + 1);
    w.atoms = std::min({floor, static_cast<int64_t>(w.summary->order().size()), pool});
    pool -= w.atoms;
  }
  // The most lookup-like blocks first.
  std::sort(flagged.begin(), flagged.end(), [&](size_t a, size_t b) { return work[a].tail > work[b].tail; });
  for (size_t i : flagged) {
    Work& w = work[i];
    if (pool >= w.size()) {
      w.exact = true;
      pool -= w.size();
      continue;
    }
    if (pool == 0) continue;  // evicted: nothing left
    w.ensure_summary().extend(pool);
    w.atoms = std::min(pool, static_cast<int64_t>(w.summary->order().size()));
    pool -= w.atoms;
  }
  using Gain = std::pair<double, size_t>;
  std::priority_queue<Gain> next;
  for (size_t i = 0; i < work.size(); ++i) {
    if (!work[i].flagged && work[i].can_grow()) next.emplace(work[i].gain(), i);
  }
  while (pool > 0 && !next.empty()) {
    const size_t i = next.top().second;
    next.pop();
    Work& w = work[i];
    ++w.atoms;
    --pool;
    if (w.can_grow()) next.emplace(w.gain(), i);
  }
}

// Spec 4.3 step 4 and 8, commit: each head's fitted atoms with their log-weights (and refitted values) replace its
// block (unit_weights: the same atoms, biases unchanged); a block kept whole is left alone; one KvCache::commit
// for the layer.
void MinimaxKvPolicy::commit_layer(KvCache& cache, int64_t layer, std::vector<Work>& work) {
  std::vector<KvHeadEdit> edits(static_cast<size_t>(heads_));
  bool any = false;
  for (Work& w : work) {
    HeadState& st = state_[static_cast<size_t>(layer * heads_ + w.head)];
    KvHeadRisk& risk = risks_[static_cast<size_t>(layer * heads_ + w.head)];
    risk.tail = w.tail;
    risk.heldout = w.heldout;
    risk.abstained = w.flagged;
    risk.exact = w.exact;
    if (w.flagged) ++st.abstentions;
    risk.abstentions = st.abstentions;
    if (w.exact) {
      risk.error = 0;
      risk.rel_error = 0;
      risk.kept = w.view.length();
      continue;
    }
    KvBlockSummary& summary = w.ensure_summary();
    const int64_t n_view = w.view.length();
    torch::Tensor mask = torch::ones({n_view}, torch::kBool);
    mask.index_fill_(0, w.block, false);
    torch::Tensor bias = w.view.bias.clone();
    torch::Tensor values;
    KvBlockSummary::Fit fit;
    if (w.atoms > 0) {
      fit = *w.fitted;  // after_layer fitted every block that keeps atoms and is not kept whole
      const torch::Tensor kept = w.block.index_select(0, fit.atoms);
      mask.index_fill_(0, kept, true);
      if (!options_.unit_weights) bias.index_add_(0, kept, fit.log_weight);
      if (fit.values.defined()) {
        values = w.view.values.to(torch::kFloat).clone();
        values.index_copy_(0, kept, fit.values);
      }
    } else {
      fit.error = summary.error()[0];
    }
    KvHeadEdit& e = edits[static_cast<size_t>(w.head)];
    e.keep = mask.nonzero().flatten();
    e.new_bias = bias.index_select(0, e.keep);
    if (values.defined()) e.new_values = values.index_select(0, e.keep);
    risk.error = std::sqrt(fit.error);
    risk.rel_error = summary.output_energy() > 0 ? std::sqrt(fit.error / summary.output_energy()) : 0.0;
    risk.kept = e.keep.numel();
    any = true;
  }
  if (any) cache.commit(layer, edits);
}

void MinimaxKvPolicy::after_step(KvCache& cache, const KvStep& step) {
  for (int64_t layer = 0; layer < cache.spec().layers; ++layer) after_layer(cache, layer, step);
}

void MinimaxKvPolicy::after_layer(KvCache& cache, int64_t layer, const KvStep& step) {
  if (!options_.budget.due(step)) return;
  const KvObservations* obs = step.observations;
  torch::NoGradGuard no_grad;
  restart_if_new(cache);
  const int64_t n = cache.next_position(layer);
  seen_[static_cast<size_t>(layer)] = n;
  int64_t pool = 0;
  std::vector<Work> work = collect_blocks(cache, layer, pool);
  if (work.empty()) return;
  if (obs == nullptr || !obs->window_queries(layer).defined()) {
    throw std::invalid_argument(
        fmt::format("MinimaxKvPolicy: layer {}: no observed queries (needs window {})", layer, options_.window));
  }
  // The heads one per intra-op thread, every library call on its own thread: the same bits on any thread count.
  const int threads = at::get_num_threads();
  LibraryCallsOnOneThread one_each;
  for_each_head(threads, work.size(), [&](size_t i) { assess_head(work[i], *obs, layer, n); });
  // Screening (max_keep_fraction), then each compressible block's summary. Where an incompressible block will be
  // served from the pool, a head screens at most its floor, so the incompressible block gets what it would get
  // without screening.
  const bool serve_flagged =
      !options_.exceed_budget && std::any_of(work.begin(), work.end(), [](const Work& w) { return w.flagged; });
  for_each_head(threads, work.size(), [&](size_t i) {
    Work& w = work[i];
    if (w.flagged) return;
    if (options_.max_rel_error == 0 && options_.max_keep_fraction < 1) {
      const int64_t cap =
          serve_flagged ? static_cast<int64_t>(std::floor(options_.alpha_safeguard * static_cast<double>(w.budget)))
                        : w.budget;
      screen_block(w, cap);
    }
    w.ensure_summary();
  });
  for (const Work& w : work) pool -= w.screened;  // kept exact outside the blocks' summaries
  allocate_budget(work, pool, threads);
  // The weights of every summarised block (an NNLS each), one head per thread; commit_layer then only edits.
  for_each_head(threads, work.size(), [&](size_t i) {
    Work& w = work[i];
    if (!w.exact && w.atoms > 0 && !w.fitted) w.fitted = w.ensure_summary().fit(w.atoms, options_.refit_values);
  });
  commit_layer(cache, layer, work);
}

}  // namespace dcp
