// Weighted block summaries (greedy selection, NNLS weights, value refit), the spectral compressibility
// estimate and the held-out risk of the minimax KV policy.
#include "infer/kv/summary.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace dcp {
namespace {

std::vector<double> to_vector(const torch::Tensor& t) {
  const torch::Tensor c = t.to(torch::kDouble).contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
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
                               torch::ScalarType dtype) {
  const int64_t n_head = view.length();
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
  if (block.min().item<int64_t>() < 0 || block.max().item<int64_t>() >= n_head) {
    throw std::invalid_argument(fmt::format("KvBlockSummary: block index outside [0, {})", n_head));
  }
  torch::NoGradGuard no_grad;
  n_ = block.numel();
  const torch::Tensor v = view.values.to(dtype);
  const torch::Tensor p = kv_head_probs(view, queries, scale, query_positions, dtype);  // [Q, n_head]
  const torch::Tensor o = torch::matmul(p, v);                                            // [Q, dv]
  probs_ = p.index_select(1, block).contiguous();  // [Q, n]
  block_values_ = v.index_select(0, block).contiguous();
  const torch::Tensor u = torch::matmul(o, block_values_.t());  // u_qi = o_q . v_i
  const torch::Tensor o2 = (o * o).sum(1);                      // [Q]
  output_energy_ = o2.mean().item<double>();
  const torch::Tensor dist2 =
      ((block_values_ * block_values_).sum(1).unsqueeze(0) - 2 * u + o2.unsqueeze(1)).clamp_min(0);
  const double mass = probs_.sum().item<double>();
  const double gamma2 = mass > 0 ? (probs_ * dist2).sum().item<double>() / mass : 1.0;
  // G_ij = mean_q p_qi p_qj [(v_i - o_q).(v_j - o_q) + gamma^2], expanded so that only [Q, n] products appear.
  const torch::Tensor m = torch::matmul((probs_ * u).t(), probs_);
  torch::Tensor gram = (torch::matmul(probs_.t(), probs_) * torch::matmul(block_values_, block_values_.t()) - m -
                        m.t() + torch::matmul(probs_.t(), probs_ * (o2 + gamma2).unsqueeze(1))) /
                       static_cast<double>(queries.size(0));
  gram = (0.5 * (gram + gram.t())).to(torch::kDouble).contiguous();
  gram_.assign(gram.data_ptr<double>(), gram.data_ptr<double>() + n_ * n_);
  c_.assign(static_cast<size_t>(n_), 0.0);
  total_ = 0;
  for (int64_t i = 0; i < n_; ++i) {
    double s = 0;
    for (int64_t j = 0; j < n_; ++j) s += gram_[static_cast<size_t>(i * n_ + j)];
    c_[static_cast<size_t>(i)] = s;
    total_ += s;
  }
  error_ = {std::max(total_, 0.0)};
  residual_ = c_;
  remaining_.resize(static_cast<size_t>(n_));
  for (int64_t i = 0; i < n_; ++i) remaining_[static_cast<size_t>(i)] = gram_[static_cast<size_t>(i * n_ + i)];
  available_.assign(static_cast<size_t>(n_), 1);
}

double KvBlockSummary::relative_error(int64_t k) const {
  if (k < 0 || k >= static_cast<int64_t>(error_.size())) {
    throw std::invalid_argument(fmt::format("KvBlockSummary::relative_error: {} outside [0, {}]", k, error_.size() - 1));
  }
  return output_energy_ > 0 ? std::sqrt(error_[static_cast<size_t>(k)] / output_energy_) : 0.0;
}

void KvBlockSummary::extend(int64_t atoms) {
  atoms = std::min(atoms, n_);
  if (static_cast<int64_t>(order_.size()) >= atoms || exhausted_) return;
  const auto n = static_cast<size_t>(n_);
  double max_diag = 0;
  for (size_t i = 0; i < n; ++i) max_diag = std::max(max_diag, gram_[i * n + i]);
  // An entry whose column is (numerically) in the span of the chosen ones adds nothing: its remaining norm is
  // below this share of the largest column's.
  const double exhausted = 1e-12 * std::max(max_diag, std::numeric_limits<double>::min());
  chol_.reserve(static_cast<size_t>(atoms) * n);
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
    const size_t step = order_.size();
    const double pivot = std::sqrt(remaining[best]);
    const double alpha = residual[best] / pivot;
    chol_.resize((step + 1) * n);
    double* column = chol_.data() + step * n;
    const double* row = gram_.data() + best * n;  // G is symmetric: row best = column best
    for (size_t i = 0; i < n; ++i) column[i] = row[i];
    for (size_t s = 0; s < step; ++s) {
      const double* done = chol_.data() + s * n;
      const double f = done[best];
      if (f == 0) continue;
      for (size_t i = 0; i < n; ++i) column[i] -= done[i] * f;
    }
    const double inv = 1.0 / pivot;
    for (size_t i = 0; i < n; ++i) {
      column[i] *= inv;
      residual[i] -= alpha * column[i];
      remaining[i] -= column[i] * column[i];
    }
    available_[best] = 0;
    order_.push_back(static_cast<int64_t>(best));
    error_.push_back(std::max(error_.back() - alpha * alpha, 0.0));
  }
  if (static_cast<int64_t>(order_.size()) == n_) exhausted_ = true;
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
  // Start from the least-squares weights of the path (clipped at 0), then coordinate descent on
  // w^T G w - 2 c^T w over w >= 0: each coordinate's exact minimiser, the gradient kept up to date.
  const torch::Tensor gt = torch::from_blob(g.data(), {atoms, atoms}, torch::kDouble);
  const torch::Tensor ridge = torch::eye(atoms, torch::kDouble) * (1e-12 * gt.diagonal().max().item<double>() + 1e-300);
  std::vector<double> w = to_vector(
      torch::linalg_solve(gt + ridge, torch::from_blob(c.data(), {atoms}, torch::kDouble)).clamp_min(0));
  std::vector<double> grad(m, 0);
  for (size_t a = 0; a < m; ++a) {
    double s = -c[a];
    for (size_t b = 0; b < m; ++b) s += g[a * m + b] * w[b];
    grad[a] = s;
  }
  for (int sweep = 0; sweep < 500; ++sweep) {
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
    if (moved < 1e-10) break;
  }
  // error = (w - 1)^T G (w - 1) over the block, with w = 0 outside the selection: total - 2 c.w + w^T G w.
  double quad = 0, lin = 0;
  for (size_t a = 0; a < m; ++a) {
    lin += c[a] * w[a];
    quad += w[a] * (grad[a] + c[a]);
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
