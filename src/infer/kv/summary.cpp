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

torch::Tensor kv_head_probs(const KvHeadView& view, const torch::Tensor& queries, double scale) {
  const torch::Tensor logits = scale * torch::matmul(queries.to(torch::kDouble), view.keys.to(torch::kDouble).t());
  return torch::softmax(logits + view.bias.to(torch::kDouble), 1);
}

KvBlockSummary::KvBlockSummary(const KvHeadView& view, const torch::Tensor& queries, double scale,
                               const torch::Tensor& block) {
  const int64_t n_head = view.length();
  if (queries.dim() != 2 || queries.size(0) < 1 || queries.size(1) != view.keys.size(1) || !(scale > 0) ||
      block.dim() != 1 || block.numel() < 1 || block.scalar_type() != torch::kInt64) {
    throw std::invalid_argument(fmt::format(
        "KvBlockSummary: queries must be [Q >= 1, {}], scale > 0 and block a non-empty 1-D int64 tensor; got "
        "queries {}, scale {}, block {}", view.keys.size(1), c10::str(queries.sizes()), scale, c10::str(block.sizes())));
  }
  if (block.min().item<int64_t>() < 0 || block.max().item<int64_t>() >= n_head) {
    throw std::invalid_argument(fmt::format("KvBlockSummary: block index outside [0, {})", n_head));
  }
  torch::NoGradGuard no_grad;
  const torch::Tensor v = view.values.to(torch::kDouble);
  const torch::Tensor p = kv_head_probs(view, queries, scale);  // [Q, n_head]
  const torch::Tensor o = torch::matmul(p, v);                                                             // [Q, dv]
  probs_ = p.index_select(1, block).contiguous();  // [Q, n]
  block_values_ = v.index_select(0, block).contiguous();
  const torch::Tensor u = torch::matmul(o, block_values_.t());  // u_qi = o_q . v_i
  const torch::Tensor o2 = (o * o).sum(1);                      // [Q]
  const torch::Tensor dist2 = ((block_values_ * block_values_).sum(1).unsqueeze(0) - 2 * u + o2.unsqueeze(1)).clamp_min(0);
  const double mass = probs_.sum().item<double>();
  const double gamma2 = mass > 0 ? (probs_ * dist2).sum().item<double>() / mass : 1.0;
  // G_ij = mean_q p_qi p_qj [(v_i - o_q).(v_j - o_q) + gamma^2], expanded so that only [Q, n] products appear.
  const torch::Tensor m = torch::matmul((probs_ * u).t(), probs_);
  gram_ = (torch::matmul(probs_.t(), probs_) * torch::matmul(block_values_, block_values_.t()) - m - m.t() +
           torch::matmul(probs_.t(), probs_ * (o2 + gamma2).unsqueeze(1))) /
          static_cast<double>(queries.size(0));
  gram_ = 0.5 * (gram_ + gram_.t());
  c_ = to_vector(gram_.sum(1));
  diag_ = to_vector(gram_.diagonal());
  total_ = 0;
  for (double x : c_) total_ += x;
  error_ = {std::max(total_, 0.0)};
  residual_ = gram_.sum(1);
  remaining_ = gram_.diagonal().clone();
  available_ = torch::ones({block.numel()}, torch::kBool);
}

void KvBlockSummary::extend(int64_t atoms) {
  const int64_t n = block_size();
  atoms = std::min(atoms, n);
  if (static_cast<int64_t>(order_.size()) >= atoms) return;
  torch::NoGradGuard no_grad;
  if (!chol_.defined() || chol_.size(1) < atoms) {
    torch::Tensor grown = torch::zeros({n, atoms}, torch::kDouble);
    if (chol_.defined()) grown.narrow(1, 0, chol_.size(1)).copy_(chol_);
    chol_ = grown;
  }
  const double max_diag = *std::max_element(diag_.begin(), diag_.end());
  // An entry whose column is (numerically) in the span of the chosen ones adds nothing: its remaining norm is
  // below this share of the largest column's.
  const double exhausted = 1e-12 * std::max(max_diag, std::numeric_limits<double>::min());
  while (static_cast<int64_t>(order_.size()) < atoms) {
    const torch::Tensor usable = available_ & (residual_ > 0) & (remaining_ > exhausted);
    const torch::Tensor gain = torch::where(usable, residual_ * residual_ / remaining_.clamp_min(exhausted),
                                            torch::zeros_like(residual_));
    const int64_t best = gain.argmax().item<int64_t>();
    if (!usable[best].item<bool>()) break;
    const int64_t step = static_cast<int64_t>(order_.size());
    const double pivot = std::sqrt(remaining_[best].item<double>());
    const double alpha = residual_[best].item<double>() / pivot;
    torch::Tensor column = gram_.select(1, best).clone();
    if (step > 0) {
      const torch::Tensor done = chol_.narrow(1, 0, step);
      column -= torch::mv(done, done[best]);
    }
    column /= pivot;
    chol_.select(1, step).copy_(column);
    residual_ -= alpha * column;
    remaining_ -= column * column;
    available_[best] = false;
    order_.push_back(best);
    error_.push_back(std::max(error_.back() - alpha * alpha, 0.0));
  }
}

KvBlockSummary::Fit KvBlockSummary::fit(int64_t atoms, bool refit_values) const {
  if (atoms < 1 || atoms > static_cast<int64_t>(order_.size())) {
    throw std::invalid_argument(
        fmt::format("KvBlockSummary::fit: atoms {} outside [1, {}] (the greedy path's length)", atoms, order_.size()));
  }
  torch::NoGradGuard no_grad;
  const auto m = static_cast<size_t>(atoms);
  const std::vector<int64_t> sel(order_.begin(), order_.begin() + atoms);
  const auto gram = gram_.accessor<double, 2>();
  std::vector<double> g(m * m), c(m);
  for (size_t a = 0; a < m; ++a) {
    c[a] = c_[static_cast<size_t>(sel[a])];
    for (size_t b = 0; b < m; ++b) g[a * m + b] = gram[sel[a]][sel[b]];
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
    const torch::Tensor weights = out.log_weight.to(torch::kDouble).exp();
    const torch::Tensor mq = probs_.index_select(1, atoms_t) * weights.unsqueeze(0);  // [Q, m]
    const torch::Tensor target = torch::matmul(probs_, block_values_);                // [Q, dv]
    const torch::Tensor normal = torch::matmul(mq.t(), mq);
    const int64_t k = atoms_t.numel();
    const double lambda = 1e-3 * normal.diagonal().mean().item<double>() + 1e-300;
    const torch::Tensor vs = block_values_.index_select(0, atoms_t);
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
                            const torch::Tensor& block, const torch::Tensor& atoms, const torch::Tensor& log_weight) {
  if (queries.dim() != 2 || queries.size(0) < 1 || queries.size(1) != view.keys.size(1) || !(scale > 0) ||
      block.dim() != 1 || block.scalar_type() != torch::kInt64 || atoms.dim() != 1 ||
      atoms.scalar_type() != torch::kInt64 || log_weight.dim() != 1 || log_weight.numel() != atoms.numel()) {
    throw std::invalid_argument(fmt::format(
        "kv_heldout_rel_error: queries must be [Q >= 1, {}], scale > 0, block and atoms 1-D int64, log_weight "
        "one per atom; got queries {}, scale {}, block {}, atoms {}, log_weight {}",
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
  const torch::Tensor p = kv_head_probs(view, queries, scale);  // [Q, n_head]
  const torch::Tensor o = torch::matmul(p, v);
  torch::Tensor w = torch::zeros({block.numel()}, torch::kDouble);
  if (atoms.numel() > 0) w.index_put_({atoms}, log_weight.to(torch::kDouble).exp());
  const torch::Tensor c = p.index_select(1, block) * (w - 1).unsqueeze(0);  // (w_i - 1) p_qi
  const double error = (torch::matmul(c, v.index_select(0, block)) - c.sum(1, true) * o).pow(2).sum().item<double>();
  const double output = o.pow(2).sum().item<double>();
  return output > 0 ? std::sqrt(error / output) : 0.0;
}

}  // namespace dcp
