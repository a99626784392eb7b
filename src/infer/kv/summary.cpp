// Weighted block summaries (greedy selection, NNLS weights, value refit), the spectral compressibility
// estimate and the held-out risk of the minimax KV policy.
#include "infer/kv/summary.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <stdexcept>

namespace dcp {
namespace {

std::vector<double> to_vector(const torch::Tensor& t) {
  const torch::Tensor c = t.to(torch::kDouble).contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

// column[i] = (((column[i] - f0 r0[i]) - f1 r1[i]) - f2 r2[i]) - f3 r3[i] with f_k = r_k[best], two entries per SSE2
// instruction (baseline x86-64: packed and scalar double arithmetic round alike, so the result is the same bits as
// the plain loop at the end, which handles an odd last entry).
void subtract_rows(double* column, size_t n, const double* r0, const double* r1, const double* r2, const double* r3,
                   size_t best) {
  using v2d = double __attribute__((vector_size(16)));
  const double f0 = r0[best], f1 = r1[best], f2 = r2[best], f3 = r3[best];
  const v2d g0 = {f0, f0}, g1 = {f1, f1}, g2 = {f2, f2}, g3 = {f3, f3};
  auto load = [](const double* p) {
    v2d x;
    std::memcpy(&x, p, sizeof x);
    return x;
  };
  size_t i = 0;
  for (; i + 2 <= n; i += 2) {
    const v2d c = load(column + i) - g0 * load(r0 + i) - g1 * load(r1 + i) - g2 * load(r2 + i) - g3 * load(r3 + i);
    std::memcpy(column + i, &c, sizeof c);
  }
  for (; i < n; ++i) column[i] = column[i] - f0 * r0[i] - f1 * r1[i] - f2 * r2[i] - f3 * r3[i];
}

}  // namespace

torch::Tensor kv_head_probs(const KvHeadView& view, const torch::Tensor& queries, double scale,
                            const torch::Tensor& query_positions, torch::ScalarType dtype) {
  torch::Tensor logits = scale * torch::matmul(queries.to(dtype), view.keys.to(dtype).t()) + view.bias.to(dtype);
  if (!query_positions.defined()) return torch::softmax(logits, 1);
  // A query saw the entries up to its own position when it ran; later ones are masked (a row with nothing
  // visible would be NaN after the softmax: the same mask then zeroes it).
  const torch::Tensor later = view.positions.unsqueeze(0) > query_positions.to(torch::kInt64).unsqueeze(1);
  return torch::softmax(logits.masked_fill(later, -std::numeric_limits<double>::infinity()), 1).masked_fill(later, 0.0);
}

KvBlockSummary::KvBlockSummary(const KvHeadView& view, const torch::Tensor& queries, double scale,
                               const torch::Tensor& block, const torch::Tensor& query_positions,
                               torch::ScalarType dtype, KvSummaryMethod method)
    : method_(method) {
  if (queries.dim() != 2 || queries.size(0) < 1 || queries.size(1) != view.keys.size(1) || !(scale > 0) ||
      block.dim() != 1 || block.numel() < 1 || block.scalar_type() != torch::kInt64 ||
      (query_positions.defined() && (query_positions.dim() != 1 || query_positions.numel() != queries.size(0))) ||
      (dtype != torch::kFloat && dtype != torch::kDouble)) {
    throw std::invalid_argument(fmt::format(
        "KvBlockSummary: queries must be [Q >= 1, {}], scale > 0, block a non-empty 1-D int64 tensor, "
        "query_positions [Q] and dtype fp32 or fp64; got queries {}, scale {}, block {}, query_positions {}, dtype {}",
        view.keys.size(1), c10::str(queries.sizes()), scale, c10::str(block.sizes()),
        query_positions.defined() ? c10::str(query_positions.sizes()) : std::string("undefined"),
        c10::toString(dtype)));
  }
  if (block.min().item<int64_t>() < 0 || block.max().item<int64_t>() >= view.length()) {
    throw std::invalid_argument(fmt::format("KvBlockSummary: block index outside [0, {})", view.length()));
  }
  torch::NoGradGuard no_grad;
  init(view, kv_head_probs(view, queries, scale, query_positions, dtype), block, dtype);
}

KvBlockSummary::KvBlockSummary(const KvHeadView& view, const torch::Tensor& probs, const torch::Tensor& block,
                               torch::ScalarType dtype, KvSummaryMethod method)
    : method_(method) {
  if (probs.dim() != 2 || probs.size(0) < 1 || probs.size(1) != view.length() || probs.scalar_type() != dtype ||
      block.dim() != 1 || block.numel() < 1 || block.scalar_type() != torch::kInt64 ||
      (dtype != torch::kFloat && dtype != torch::kDouble)) {
    throw std::invalid_argument(fmt::format(
        "KvBlockSummary: probs must be [Q >= 1, {}] in the summary dtype, block a non-empty 1-D int64 tensor and "
        "dtype fp32 or fp64; got probs {} {}, block {}, dtype {}",
        view.length(), c10::str(probs.sizes()), c10::toString(probs.scalar_type()), c10::str(block.sizes()),
        c10::toString(dtype)));
  }
  if (block.min().item<int64_t>() < 0 || block.max().item<int64_t>() >= view.length()) {
    throw std::invalid_argument(fmt::format("KvBlockSummary: block index outside [0, {})", view.length()));
  }
  torch::NoGradGuard no_grad;
  init(view, probs, block, dtype);
}

KvBlockResponse::KvBlockResponse(const KvHeadView& view, const torch::Tensor& p, const torch::Tensor& block) {
  const torch::Tensor v = view.values.to(p.scalar_type());
  const torch::Tensor o = torch::matmul(p, v);  // [Q, dv]
  probs = p.index_select(1, block).contiguous();  // [Q, n]
  values = v.index_select(0, block).contiguous();
  u = torch::matmul(o, values.t()).contiguous();  // u_qi = o_q . v_i
  o2 = (o * o).sum(1);                             // [Q]
  dist2 = ((values * values).sum(1).unsqueeze(0) - 2 * u + o2.unsqueeze(1)).clamp_min(0);
  const double mass = probs.sum().item<double>();
  gamma2 = mass > 0 ? (probs * dist2).sum().item<double>() / mass : 1.0;
}

void KvBlockSummary::init(const KvHeadView& view, const torch::Tensor& p, const torch::Tensor& block,
                          torch::ScalarType dtype) {
  n_ = block.numel();
  const auto n = static_cast<size_t>(n_);
  const KvBlockResponse r(view, p, block);
  probs_ = r.probs;
  block_values_ = r.values;
  output_energy_ = r.o2.mean().item<double>();
  form_gram(r.u, r.o2 + r.gamma2, dtype);
  c_.assign(n, 0.0);
  remaining_.resize(n);
  total_ = 0;
  max_diag_ = 0;
  for (size_t i = 0; i < n; ++i) {
    double sum = 0;
    const double* row = gram_.data() + i * n;
    for (size_t j = 0; j < n; ++j) sum += row[j];
    c_[i] = sum;
    total_ += sum;
    remaining_[i] = row[i];
    max_diag_ = std::max(max_diag_, row[i]);
  }
  error_ = {std::max(total_, 0.0)};
  residual_ = c_;
  available_.assign(n, 1);
}


void KvBlockSummary::form_gram(const torch::Tensor& u, const torch::Tensor& s, torch::ScalarType dtype) {
  const auto n = static_cast<size_t>(n_);
  const double queries = static_cast<double>(probs_.size(0));
  gram_.resize(n * n);
  if (dtype == torch::kDouble) {
    // The reference twin: G_ij = mean_q p_qi p_qj [(v_i - o_q).(v_j - o_q) + gamma^2], expanded so that only
    // [Q, n] products appear.
    const torch::Tensor m = torch::matmul((probs_ * u).t(), probs_);
    torch::Tensor gram = (torch::matmul(probs_.t(), probs_) * torch::matmul(block_values_, block_values_.t()) - m -
                          m.t() + torch::matmul(probs_.t(), probs_ * s.unsqueeze(1))) /
                         queries;
    gram = (0.5 * (gram + gram.t())).contiguous();
    gram_.assign(gram.data_ptr<double>(), gram.data_ptr<double>() + n * n);
  } else {
    // The fast path: p_qi p_qj (s_q - u_qi - u_qj) = b_qi p_qj + p_qi b_qj with b_qi = p_qi (s_q / 2 - u_qi),
    // so G = (P^T P o V V^T + B^T P + (B^T P)^T) / Q: one [2n, Q] x [Q, n] matmul and V V^T, then one pass over
    // the upper triangle (each entry formed once, mirrored: G is symmetric by construction).
    const torch::Tensor b = probs_ * (0.5 * s.unsqueeze(1) - u);
    const torch::Tensor pp_bp = torch::matmul(torch::cat({probs_, b}, 1).t(), probs_).contiguous();  // [2n, n]
    const torch::Tensor vv = torch::matmul(block_values_, block_values_.t()).contiguous();         // [n, n]
    const float* pp = pp_bp.data_ptr<float>();
    const float* bp = pp + n * n;
    const float* w = vv.data_ptr<float>();
    const double inv = 1.0 / queries;
    double* g = gram_.data();
    // In tiles of 64 x 64 (the upper triangle's tiles and their mirror images): the transposed reads of bp and
    // writes of g stay in L1/L2 where whole rows (n up to a few thousand) would not. Each entry is the same
    // expression as a plain loop over i <= j computes.
    constexpr size_t kTile = 64;
    for (size_t i0 = 0; i0 < n; i0 += kTile) {
      const size_t i1 = std::min(n, i0 + kTile);
      for (size_t j0 = i0; j0 < n; j0 += kTile) {
        const size_t j1 = std::min(n, j0 + kTile);
        for (size_t i = i0; i < i1; ++i) {
          for (size_t j = std::max(i, j0); j < j1; ++j) {
            const double x = (static_cast<double>(pp[i * n + j]) * static_cast<double>(w[i * n + j]) +
                              static_cast<double>(bp[i * n + j]) + static_cast<double>(bp[j * n + i])) *
                             inv;
            g[i * n + j] = x;
            g[j * n + i] = x;
          }
        }
      }
    }
  }
}

double KvBlockSummary::relative_error(int64_t k) const {
  if (k < 0 || k >= static_cast<int64_t>(error_.size())) {
    throw std::invalid_argument(fmt::format("KvBlockSummary::relative_error: {} outside [0, {}]", k, error_.size() - 1));
  }
  return output_energy_ > 0 ? std::sqrt(error_[static_cast<size_t>(k)] / output_energy_) : 0.0;
}

namespace {
constexpr int64_t kBlock = 32;  // steps per rank-k update of the Schur complement (KvSummaryMethod::kBlocked, kAuto)
}  // namespace

void KvBlockSummary::extend(int64_t atoms) {
  atoms = std::min(atoms, n_);
  if (static_cast<int64_t>(order_.size()) >= atoms || exhausted_) return;
  const auto n = static_cast<size_t>(n_);
  // An entry whose column is (numerically) in the span of the chosen ones adds nothing: its remaining norm is
  // below this share of the largest column's.
  const double exhausted = 1e-12 * std::max(max_diag_, std::numeric_limits<double>::min());
  // Left-looking while the path is short, then blocked right-looking (KvSummaryMethod): kAuto once the columns
  // so far hold 4 MiB (2^19 fp64 values: beyond the caches, where each step's matrix-vector product is
  // memory-bound) and n / 8 steps; kBlocked from max(32, n / 8) steps on whatever the size; kPlain never.
  const int64_t switch_at = method_ == KvSummaryMethod::kPlain     ? std::numeric_limits<int64_t>::max()
                            : method_ == KvSummaryMethod::kBlocked ? std::max<int64_t>(kBlock, n_ / 8)
                                                                   : std::max<int64_t>(n_ / 8, ((int64_t{1} << 19) + n_ - 1) / n_);
  double* residual = residual_.data();
  double* remaining = remaining_.data();
  while (static_cast<int64_t>(order_.size()) < atoms) {
    // The entry that lowers the residual most: gain r_i^2 / remaining_i among usable entries (first on ties).
    size_t best = n;
    double best_gain = 0;
    for (size_t i = 0; i < n; ++i) {
      if (!available_[i] || !(residual[i] > 0) || !(remaining[i] > exhausted)) continue;
      const double gain = residual[i] * residual[i] / remaining[i];
      if (best == n || gain > best_gain) {
        best = i;
        best_gain = gain;
      }
    }
    if (best == n) {
      exhausted_ = true;
      break;
    }
    const auto step = static_cast<int64_t>(order_.size());
    const double pivot = std::sqrt(remaining[best]);
    const double alpha = residual[best] / pivot;
    const double inv = 1.0 / pivot;
    if (!blocked_ && step >= switch_at) start_blocked();
    {
      // Row `step` of the path's Cholesky factor (G over the path's entries, in path order): the earlier
      // columns at the pivot, then the pivot. The weight fit starts from it instead of factorising G_SS again.
      factor_.resize(factor_.size() + static_cast<size_t>(step) + 1);
      double* frow = factor_.data() + static_cast<size_t>(step) * static_cast<size_t>(step + 1) / 2;
      const double* stored = chol_.defined() ? chol_.data_ptr<double>() : nullptr;
      const int64_t columns = blocked_ ? step - pending_count_ : step;  // in chol_; the rest pending
      int64_t s = 0;
      for (; s < columns; ++s) frow[s] = stored[static_cast<size_t>(s) * n + best];
      if (blocked_) {
        const auto na = static_cast<int64_t>(active_.size());
        const double* pend = pending_.data_ptr<double>();
        for (int64_t j = 0; j < pending_count_; ++j) frow[s++] = pend[j * na + active_at_[best]];
      }
      frow[step] = pivot;
    }
    if (blocked_) {
      // The Schur complement's row of the pivot less the block's pending columns at the pivot: the new column
      // over the entries R covers, stored as the block's next pending column.
      const auto na = static_cast<int64_t>(active_.size());
      const int64_t at = active_at_[best];
      double* pend = pending_.data_ptr<double>();
      double* col = pend + pending_count_ * na;
      const double* row = schur_.data_ptr<double>() + at * na;
      std::copy(row, row + na, col);
      for (int64_t s = 0; s < pending_count_; ++s) {
        const double* ls = pend + s * na;
        const double fs = ls[at];
        if (fs == 0) continue;
        for (int64_t t = 0; t < na; ++t) col[t] -= fs * ls[t];
      }
      for (int64_t t = 0; t < na; ++t) {
        col[t] *= inv;
        const auto i = static_cast<size_t>(active_[static_cast<size_t>(t)]);
        residual[i] -= alpha * col[t];
        remaining[i] -= col[t] * col[t];
      }
      ++pending_count_;
    } else {
      reserve_columns(step + 1, step, atoms);
      double* base = chol_.data_ptr<double>();
      double* column = base + static_cast<size_t>(step) * n;
      const double* g = gram_.data() + best * n;  // G is symmetric: row best = column best
      // column = G[:, best] - sum_s L_s L_s[best], the columns taken so far subtracted in order, four rows per
      // sweep over the column (((c - a0) - a1) - a2) - a3, as one at a time would): a loop on this thread rather
      // than a BLAS dgemv, whose threaded form sums in another order on another number of threads, so that a path
      // is the same bits whichever thread grows it (minimax grows its heads' paths in parallel).
      std::copy(g, g + n, column);
      int64_t s = 0;
      for (; s + 4 <= step; s += 4) {
        const double* r0 = base + static_cast<size_t>(s) * n;
        subtract_rows(column, n, r0, r0 + n, r0 + 2 * n, r0 + 3 * n, best);
      }
      for (; s < step; ++s) {
        const double* r0 = base + static_cast<size_t>(s) * n;
        const double f0 = r0[best];
        for (size_t i = 0; i < n; ++i) column[i] -= f0 * r0[i];
      }
      for (size_t i = 0; i < n; ++i) {
        column[i] *= inv;
        residual[i] -= alpha * column[i];
        remaining[i] -= column[i] * column[i];
      }
    }
    available_[best] = 0;
    order_.push_back(static_cast<int64_t>(best));
    error_.push_back(std::max(error_.back() - alpha * alpha, 0.0));
    if (blocked_ && pending_count_ == kBlock) flush_block();
  }
  if (static_cast<int64_t>(order_.size()) == n_) exhausted_ = true;
}

void KvBlockSummary::reserve_columns(int64_t rows, int64_t keep, int64_t hint) {
  if (chol_.defined() && chol_.size(0) >= rows) return;
  // Room for the request (at least double the old), the first `keep` rows copied over.
  const int64_t old = chol_.defined() ? chol_.size(0) : 0;
  const int64_t capacity = std::min(n_, std::max<int64_t>({hint, rows, 2 * old, 16}));
  torch::Tensor grown = torch::empty({capacity, n_}, torch::kDouble);
  keep = std::min(keep, old);
  if (keep > 0) grown.narrow(0, 0, keep).copy_(chol_.narrow(0, 0, keep));
  chol_ = grown;
}

void KvBlockSummary::start_blocked() {
  const auto steps = static_cast<int64_t>(order_.size());
  active_.clear();
  active_at_.assign(static_cast<size_t>(n_), -1);
  for (int64_t i = 0; i < n_; ++i) {
    if (!available_[static_cast<size_t>(i)]) continue;
    active_at_[static_cast<size_t>(i)] = static_cast<int64_t>(active_.size());
    active_.push_back(i);
  }
  const auto na = static_cast<int64_t>(active_.size());
  const torch::Tensor idx = torch::from_blob(active_.data(), {na}, torch::kInt64);
  const torch::Tensor gram = torch::from_blob(gram_.data(), {n_, n_}, torch::kDouble);
  torch::Tensor schur = gram.index_select(0, idx).index_select(1, idx).contiguous();
  if (steps > 0) {
    const torch::Tensor l = chol_.narrow(0, 0, steps).index_select(1, idx);  // [steps, na]
    schur.addmm_(l.t(), l, 1.0, -1.0);
  }
  schur_ = schur;
  pending_ = torch::empty({kBlock, std::max<int64_t>(na, 1)}, torch::kDouble);
  pending_count_ = 0;
  blocked_ = true;
}

void KvBlockSummary::flush_block() {
  const auto na = static_cast<int64_t>(active_.size());
  if (pending_count_ > 0 && na > 0) {
    const torch::Tensor l = pending_.narrow(0, 0, pending_count_).narrow(1, 0, na);
    schur_.addmm_(l.t(), l, 1.0, -1.0);  // one rank-k update (BLAS-3)
    // The block's columns join the left-looking ones in chol_ (over every entry; 0 at those R no longer
    // covers, which are taken), where the factor's rows of later steps read them.
    const auto first = static_cast<int64_t>(order_.size()) - pending_count_;
    reserve_columns(first + pending_count_, first, 0);
    for (int64_t j = 0; j < pending_count_; ++j) {
      double* row = chol_.data_ptr<double>() + static_cast<size_t>(first + j) * static_cast<size_t>(n_);
      const double* col = pending_.data_ptr<double>() + j * na;
      std::fill(row, row + n_, 0.0);
      for (int64_t t = 0; t < na; ++t) row[active_[static_cast<size_t>(t)]] = col[t];
    }
  }
  pending_count_ = 0;
  // Entries taken leave R once they are at least 1/16 of it (copying R costs less than updating their rows).
  std::vector<int64_t> keep;
  keep.reserve(active_.size());
  for (int64_t t = 0; t < na; ++t) {
    if (available_[static_cast<size_t>(active_[static_cast<size_t>(t)])]) keep.push_back(t);
  }
  const auto kept = static_cast<int64_t>(keep.size());
  if (na - kept < std::max<int64_t>(1, na / 16)) return;
  const torch::Tensor idx = torch::from_blob(keep.data(), {kept}, torch::kInt64);
  schur_ = schur_.index_select(0, idx).index_select(1, idx).contiguous();
  std::vector<int64_t> active;
  active.reserve(keep.size());
  for (int64_t t : keep) active.push_back(active_[static_cast<size_t>(t)]);
  active_.swap(active);
  std::fill(active_at_.begin(), active_at_.end(), -1);
  for (int64_t t = 0; t < kept; ++t) active_at_[static_cast<size_t>(active_[static_cast<size_t>(t)])] = t;
  pending_ = torch::empty({kBlock, std::max<int64_t>(kept, 1)}, torch::kDouble);
}

KvBlockSummary::Fit KvBlockSummary::fit(int64_t atoms, bool refit_values) const {
  if (atoms < 1 || atoms > static_cast<int64_t>(order_.size())) {
    throw std::invalid_argument(
        fmt::format("KvBlockSummary::fit: atoms {} outside [1, {}] (the greedy path's length)", atoms, order_.size()));
  }
  torch::NoGradGuard no_grad;
  const auto m = static_cast<size_t>(atoms);
  const std::vector<int64_t> sel(order_.begin(), order_.begin() + atoms);
  std::vector<double> g(m * m), c(m);
  for (size_t a = 0; a < m; ++a) {
    c[a] = c_[static_cast<size_t>(sel[a])];
    for (size_t b = 0; b < m; ++b) g[a * m + b] = gram_[static_cast<size_t>(sel[a] * n_ + sel[b])];
  }
  // The path's factor of G_SS (its leading m x m block: packed rows), so the fit starts without factorising.
  const std::vector<double> factor(factor_.begin(), factor_.begin() + static_cast<std::ptrdiff_t>(m * (m + 1) / 2));
  const std::vector<double> w = kv_nnls(g, c, factor);
  std::vector<double> gw(m, 0);
  for (size_t a = 0; a < m; ++a) {
    double sum = 0;
    for (size_t b = 0; b < m; ++b) sum += g[a * m + b] * w[b];
    gw[a] = sum;
  }
  // error = (w - 1)^T G (w - 1) over the block, with w = 0 outside the selection: total - 2 c.w + w^T G w.
  double quad = 0, lin = 0;
  for (size_t a = 0; a < m; ++a) {
    lin += c[a] * w[a];
    quad += w[a] * gw[a];
  }
  Fit out;
  out.error = std::max(total_ - 2 * lin + quad, 0.0);
  std::vector<std::pair<int64_t, double>> kept;
  for (size_t a = 0; a < m; ++a) {
    if (w[a] > 0) kept.emplace_back(sel[a], w[a]);
  }
  std::sort(kept.begin(), kept.end());
  std::vector<int64_t> idx;
  std::vector<float> logw;
  for (const auto& [i, wi] : kept) {
    idx.push_back(i);
    logw.push_back(static_cast<float>(std::log(wi)));
  }
  out.atoms = torch::tensor(idx, torch::kInt64);
  out.log_weight = torch::tensor(logw, torch::kFloat);
  if (refit_values && !idx.empty()) {
    // Values X [m, dv] with sum_j p_qj w_j x_j = sum_i p_qi v_i (the block's numerator) on every reference
    // query, ridge lambda ||X - V_S||^2 towards the kept values: well posed when m exceeds the queries.
    const torch::Tensor atoms_t = out.atoms;
    const torch::Tensor probs = probs_.to(torch::kDouble), block_values = block_values_.to(torch::kDouble);
    const torch::Tensor weights = out.log_weight.to(torch::kDouble).exp();
    const torch::Tensor mq = probs.index_select(1, atoms_t) * weights.unsqueeze(0);  // [Q, m]
    const torch::Tensor target = torch::matmul(probs, block_values);                 // [Q, dv]
    const torch::Tensor normal = torch::matmul(mq.t(), mq);
    const int64_t k = atoms_t.numel();
    const double lambda = 1e-3 * normal.diagonal().mean().item<double>() + 1e-300;
    const torch::Tensor vs = block_values.index_select(0, atoms_t);
    out.values = torch::linalg_solve(normal + lambda * torch::eye(k, torch::kDouble),
                                     torch::matmul(mq.t(), target) + lambda * vs)
                     .to(torch::kFloat);
  }
  return out;
}

namespace {

void check_nnls(const char* who, const std::vector<double>& g, const std::vector<double>& c) {
  if (g.size() != c.size() * c.size()) {
    throw std::invalid_argument(
        fmt::format("{}: G must have m x m = {} elements for c of m = {}; got {}", who, c.size() * c.size(), c.size(), g.size()));
  }
  for (size_t i = 0; i < g.size(); ++i) {
    if (!std::isfinite(g[i])) throw std::invalid_argument(fmt::format("{}: G[{}] = {} is not finite", who, i, g[i]));
  }
  for (size_t i = 0; i < c.size(); ++i) {
    if (!std::isfinite(c[i])) throw std::invalid_argument(fmt::format("{}: c[{}] = {} is not finite", who, i, c[i]));
  }
}

double ridge_of(const std::vector<double>& g, size_t m) {
  double max_diag = 0;
  for (size_t a = 0; a < m; ++a) max_diag = std::max(max_diag, g[a * m + a]);
  return 1e-12 * max_diag + 1e-300;
}

// The Cholesky factor U (upper triangular, U^T U = G_PP + ridge I) of the passive set P, an ordered list of
// indices, kept under the active-set method's changes: an index appended costs one forward substitution and an
// index removed one rank-1 update of the trailing factor (Golub and Van Loan, Matrix Computations, 4th ed.,
// 6.5.4, "updating and downdating"), O(k^2) each, where a fresh factorisation costs O(k^3). The ridge
// (1e-12 x max diag G) keeps G_PP positive definite when columns are (numerically) dependent; where a
// factorisation or an append fails anyway, the set is factorised afresh with the ridge grown a thousandfold
// until it holds (at most 1e-3 x max diag: far below any weight's effect); a G that fails even then (not positive
// semi-definite) is refused with std::invalid_argument. A factor handed over by the caller
// (assign_lower_packed: the greedy path's, of G_PP itself) has no ridge on its rows; indices appended later get it.
class PassiveFactor {
 public:
  PassiveFactor(const std::vector<double>& g, size_t m, double ridge) : g_(g), m_(m), ridge_(ridge), used_(ridge), u_(m * m) {}
  const std::vector<size_t>& set() const { return set_; }

  void reset(std::vector<size_t> set) {
    set_ = std::move(set);
    used_ = ridge_;
    const size_t k = set_.size();
    if (k == 0) return;
    const auto kk = static_cast<int64_t>(k);
    torch::Tensor a = torch::empty({kk, kk}, torch::kDouble);
    double* pa = a.data_ptr<double>();
    for (size_t i = 0; i < k; ++i) {
      const double* row = g_.data() + set_[i] * m_;
      for (size_t j = 0; j < k; ++j) pa[i * k + j] = row[set_[j]];
      pa[i * k + i] += ridge_;
    }
    auto [l, info] = torch::linalg_cholesky_ex(a);
    double extra = ridge_;
    for (int grow = 0; grow < 3 && info.item<int64_t>() != 0; ++grow) {  // 1e3, 1e6, 1e9 x the ridge
      extra *= 1e3;
      std::tie(l, info) = torch::linalg_cholesky_ex(a + extra * torch::eye(kk, torch::kDouble));
      used_ = ridge_ + extra;
    }
    if (info.item<int64_t>() != 0) {
      throw std::invalid_argument(fmt::format(
          "kv_nnls: G restricted to {} indices is not positive semi-definite (Cholesky fails with a ridge of {:g}, "
          "1e-3 x max diag G): not a Gram matrix",
          k, used_));
    }
    const torch::Tensor lc = l.contiguous();
    const double* pl = lc.data_ptr<double>();
    for (size_t i = 0; i < k; ++i) {
      for (size_t j = i; j < k; ++j) at(i, j) = pl[j * k + i];  // U = L^T
    }
  }

  // The set 0..m-1 with a factor given as L (lower triangular, packed by rows: row i holds L[i][0..i]): U = L^T.
  void assign_lower_packed(const std::vector<double>& packed) {
    set_.resize(m_);
    used_ = ridge_;
    for (size_t i = 0; i < m_; ++i) {
      set_[i] = i;
      const double* row = packed.data() + i * (i + 1) / 2;
      for (size_t j = 0; j <= i; ++j) at(j, i) = row[j];
    }
  }

  // Index a joins the end of the set: U's new column l solves U^T l = G_Pa, its diagonal sqrt(G_aa + ridge - l.l).
  void append(size_t a) {
    const size_t k = set_.size();
    std::vector<double> l(k);
    for (size_t i = 0; i < k; ++i) l[i] = g_[set_[i] * m_ + a];
    forward(l);
    double d2 = g_[a * m_ + a] + used_;
    for (double x : l) d2 -= x * x;
    if (!(d2 > 1e-14 * (g_[a * m_ + a] + used_))) {  // (numerically) in the span of the set: factorise afresh
      std::vector<size_t> set = set_;
      set.push_back(a);
      reset(std::move(set));
      return;
    }
    for (size_t i = 0; i < k; ++i) at(i, k) = l[i];
    at(k, k) = std::sqrt(d2);
    set_.push_back(a);
  }

  // The set's entry at position p leaves: G_PP without row and column p is U11^T U11 beside the trailing block
  // U33^T U33 + x^T x with x = U's row p right of the diagonal; a rank-1 update of U33, then U's row and column
  // p are taken out.
  void remove(size_t p) {
    const size_t k = set_.size();
    std::vector<double> x(k, 0.0);
    for (size_t j = p + 1; j < k; ++j) x[j] = at(p, j);
    for (size_t t = p + 1; t < k; ++t) {
      const double d = at(t, t);
      const double r = std::hypot(d, x[t]);
      const double cs = r / d, sn = x[t] / d;
      at(t, t) = r;
      double* row = u_.data() + t * m_;
      for (size_t i = t + 1; i < k; ++i) {
        row[i] = (row[i] + sn * x[i]) / cs;
        x[i] = cs * x[i] - sn * row[i];
      }
    }
    for (size_t i = 0; i < p; ++i) {
      double* row = u_.data() + i * m_;
      for (size_t j = p + 1; j < k; ++j) row[j - 1] = row[j];
    }
    for (size_t i = p + 1; i < k; ++i) {
      const double* from = u_.data() + i * m_;
      double* to = u_.data() + (i - 1) * m_;
      for (size_t j = i; j < k; ++j) to[j - 1] = from[j];
    }
    set_.erase(set_.begin() + static_cast<std::ptrdiff_t>(p));
  }

  // z_P = (G_PP + ridge I)^-1 c_P, 0 elsewhere.
  void solve(const std::vector<double>& c, std::vector<double>& z) const {
    std::fill(z.begin(), z.end(), 0.0);
    const size_t k = set_.size();
    std::vector<double> y(k);
    for (size_t i = 0; i < k; ++i) y[i] = c[set_[i]];
    forward(y);
    for (size_t i = k; i-- > 0;) {  // U z = y
      const double* row = u_.data() + i * m_;
      double sum = y[i];
      for (size_t j = i + 1; j < k; ++j) sum -= row[j] * y[j];
      y[i] = sum / row[i];
    }
    for (size_t i = 0; i < k; ++i) z[set_[i]] = y[i];
  }

 private:
  double& at(size_t i, size_t j) { return u_[i * m_ + j]; }
  // x <- U^-T x (U^T lower triangular), row by row of U.
  void forward(std::vector<double>& x) const {
    const size_t k = x.size();
    for (size_t j = 0; j < k; ++j) {
      const double* row = u_.data() + j * m_;
      x[j] /= row[j];
      const double xj = x[j];
      for (size_t i = j + 1; i < k; ++i) x[i] -= row[i] * xj;
    }
  }

  const std::vector<double>& g_;
  size_t m_;
  double ridge_, used_;
  std::vector<double> u_;  // [m, m] row-major; the leading k x k upper triangle is U
  std::vector<size_t> set_;
};

// Takes the positions whose index `drop` marks out of the factor: one by one from the last (each O(k^2)) when
// few leave, else one fresh factorisation of what stays.
template <typename Drop>
void remove_where(PassiveFactor& f, Drop drop) {
  const std::vector<size_t> set = f.set();
  std::vector<size_t> stay, gone;
  for (size_t p = 0; p < set.size(); ++p) (drop(set[p]) ? gone : stay).push_back(p);
  if (gone.empty()) return;
  if (gone.size() * 8 > set.size()) {
    std::vector<size_t> kept;
    for (size_t p : stay) kept.push_back(set[p]);
    f.reset(std::move(kept));
    return;
  }
  for (size_t i = gone.size(); i-- > 0;) f.remove(gone[i]);
}

}  // namespace

std::vector<double> kv_nnls(const std::vector<double>& g, const std::vector<double>& c,
                            const std::vector<double>& given) {
  check_nnls("kv_nnls", g, c);
  if (!given.empty() && given.size() != c.size() * (c.size() + 1) / 2) {
    throw std::invalid_argument(fmt::format("kv_nnls: the factor must hold m (m + 1) / 2 = {} values for m = {}; got {}",
                                            c.size() * (c.size() + 1) / 2, c.size(), given.size()));
  }
  const size_t m = c.size();
  if (m == 0) return {};
  const double ridge = ridge_of(g, m);
  std::vector<double> w(m), z(m);
  PassiveFactor factor(g, m, ridge);
  std::vector<size_t> all(m);
  for (size_t a = 0; a < m; ++a) all[a] = a;
  // Warm start: the least-squares weights clipped at 0; the positive ones are the passive set.
  if (given.empty()) {
    factor.reset(all);
  } else {
    factor.assign_lower_packed(given);
  }
  factor.solve(c, w);
  std::vector<char> passive(m, 0);
  for (size_t a = 0; a < m; ++a) {
    w[a] = std::max(w[a], 0.0);
    passive[a] = w[a] > 0;
  }
  remove_where(factor, [&](size_t a) { return !passive[a]; });
  double max_c = 0;
  for (double x : c) max_c = std::max(max_c, std::abs(x));
  const double tol = 1e-12 * max_c;
  const size_t limit = 4 * m + 16;
  size_t changes = 0;
  while (changes <= limit) {
    // Inner loop: the unconstrained optimum on the passive set; where it leaves the feasible set, move from w
    // towards it as far as feasibility allows and drop the weights that reach 0.
    for (;;) {
      factor.solve(c, z);
      double alpha = 1;
      size_t stop = m;
      for (size_t a : factor.set()) {
        if (z[a] > 0) continue;
        const double step = w[a] / (w[a] - z[a]);  // w_a >= 0 > z_a - w_a: in [0, 1)
        if (stop == m || step < alpha) {
          alpha = step;
          stop = a;
        }
      }
      if (stop == m) {
        w = z;
        break;
      }
      for (size_t a : factor.set()) {
        w[a] += alpha * (z[a] - w[a]);
        if (a == stop || w[a] <= 0) {
          w[a] = 0;
          passive[a] = 0;
        }
      }
      remove_where(factor, [&](size_t a) { return !passive[a]; });
      if (++changes > limit) break;
    }
    // Outer loop: the zero weight with the steepest descent direction (c - G w)_a joins the passive set.
    size_t best = m;
    double best_d = tol;
    for (size_t a = 0; a < m; ++a) {
      if (passive[a]) continue;
      double d = c[a];
      for (size_t b = 0; b < m; ++b) d -= g[a * m + b] * w[b];
      if (d > best_d) {
        best = a;
        best_d = d;
      }
    }
    if (best == m) break;
    passive[best] = 1;
    factor.append(best);
    ++changes;
  }
  for (double& x : w) x = std::max(x, 0.0);
  return w;
}

std::vector<double> kv_nnls_reference(const std::vector<double>& g, const std::vector<double>& c, int sweeps,
                                      double tol) {
  check_nnls("kv_nnls_reference", g, c);
  const size_t m = c.size();
  if (m == 0) return {};
  torch::NoGradGuard no_grad;
  const auto atoms = static_cast<int64_t>(m);
  std::vector<double> gc = g, cc = c;  // from_blob needs mutable storage
  const torch::Tensor gt = torch::from_blob(gc.data(), {atoms, atoms}, torch::kDouble);
  const torch::Tensor ridge = torch::eye(atoms, torch::kDouble) * ridge_of(g, m);
  std::vector<double> w = to_vector(
      torch::linalg_solve(gt + ridge, torch::from_blob(cc.data(), {atoms}, torch::kDouble)).clamp_min(0));
  std::vector<double> grad(m, 0);
  for (size_t a = 0; a < m; ++a) {
    double s = -c[a];
    for (size_t b = 0; b < m; ++b) s += g[a * m + b] * w[b];
    grad[a] = s;
  }
  for (int sweep = 0; sweep < sweeps; ++sweep) {
    double moved = 0;
    for (size_t a = 0; a < m; ++a) {
      const double gaa = g[a * m + a];
      if (gaa <= 0) continue;
      const double next = std::max(0.0, w[a] - grad[a] / gaa);
      const double delta = next - w[a];
      if (delta == 0) continue;
      w[a] = next;
      for (size_t b = 0; b < m; ++b) grad[b] += delta * g[b * m + a];
      moved = std::max(moved, std::abs(delta));
    }
    if (moved < tol) break;
  }
  return w;
}

double kv_spectral_tail(const torch::Tensor& probs, const torch::Tensor& values, int64_t keep) {
  if (probs.dim() != 2 || values.dim() != 2 || values.size(0) != probs.size(1) || keep < 0 || keep > probs.size(1)) {
    throw std::invalid_argument(fmt::format(
        "kv_spectral_tail: probs must be [Q, S], values [S, dv] and keep in [0, S]; got probs {}, values {}, keep {}",
        c10::str(probs.sizes()), c10::str(values.sizes()), keep));
  }
  torch::NoGradGuard no_grad;
  const torch::Tensor p = probs.to(torch::kDouble), v = values.to(torch::kDouble);
  torch::Tensor gram = torch::matmul(p.t(), p) * (torch::matmul(v, v.t()) + 1.0);
  gram = 0.5 * (gram + gram.t());
  const torch::Tensor eig = torch::linalg_eigvalsh(gram).clamp_min(0);  // ascending
  const double total = eig.sum().item<double>();
  if (!(total > 0)) return 0;
  const int64_t s = eig.numel();
  return std::clamp(eig.narrow(0, 0, s - keep).sum().item<double>() / total, 0.0, 1.0);
}

double kv_heldout_rel_error(const KvHeadView& view, const torch::Tensor& queries, double scale,
                            const torch::Tensor& block, const torch::Tensor& atoms, const torch::Tensor& log_weight,
                            const torch::Tensor& query_positions) {
  if (queries.dim() != 2 || queries.size(0) < 1 || queries.size(1) != view.keys.size(1) || !(scale > 0) ||
      block.dim() != 1 || block.scalar_type() != torch::kInt64 || atoms.dim() != 1 ||
      atoms.scalar_type() != torch::kInt64 || log_weight.dim() != 1 || log_weight.numel() != atoms.numel() ||
      (query_positions.defined() && (query_positions.dim() != 1 || query_positions.numel() != queries.size(0)))) {
    throw std::invalid_argument(fmt::format(
        "kv_heldout_rel_error: queries must be [Q >= 1, {}], scale > 0, block and atoms 1-D int64, log_weight "
        "one per atom, query_positions one per query; got queries {}, scale {}, block {}, atoms {}, log_weight {}",
        view.keys.size(1), c10::str(queries.sizes()), scale, c10::str(block.sizes()), c10::str(atoms.sizes()),
        c10::str(log_weight.sizes())));
  }
  const auto outside = [](const torch::Tensor& idx, int64_t n) {
    return idx.numel() > 0 && (idx.min().item<int64_t>() < 0 || idx.max().item<int64_t>() >= n);
  };
  if (outside(block, view.length()) || outside(atoms, block.numel())) {
    throw std::invalid_argument(fmt::format("kv_heldout_rel_error: block indices must lie in [0, {}) and atoms in "
                                            "[0, {})", view.length(), block.numel()));
  }
  torch::NoGradGuard no_grad;
  const torch::Tensor v = view.values.to(torch::kDouble);
  const torch::Tensor p = kv_head_probs(view, queries, scale, query_positions);  // [Q, n_head]
  const torch::Tensor o = torch::matmul(p, v);
  torch::Tensor w = torch::zeros({block.numel()}, torch::kDouble);
  if (atoms.numel() > 0) w.index_put_({atoms}, log_weight.to(torch::kDouble).exp());
  const torch::Tensor c = p.index_select(1, block) * (w - 1).unsqueeze(0);  // (w_i - 1) p_qi
  const double error = (torch::matmul(c, v.index_select(0, block)) - c.sum(1, true) * o).pow(2).sum().item<double>();
  const double output = o.pow(2).sum().item<double>();
  return output > 0 ? std::sqrt(error / output) : 0.0;
}

}  // namespace dcp
