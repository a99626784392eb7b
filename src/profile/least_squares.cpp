// fit_nonnegative_least_squares (dcp/profiler.h): the solver of every fit `dcp profile` makes.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "profile/profiler.h"

namespace dcp {

namespace {

constexpr size_t kMaxColumns = 8;

// Solves a x = b (n x n, row-major) by Gaussian elimination with partial pivoting; false when a pivot is
// negligible against the largest entry of its column (the subset of columns is degenerate).
bool solve(std::vector<std::vector<double>> a, std::vector<double> b, std::vector<double>& x) {
  const size_t n = b.size();
  for (size_t col = 0; col < n; ++col) {
    size_t pivot = col;
    for (size_t r = col + 1; r < n; ++r) {
      if (std::abs(a[r][col]) > std::abs(a[pivot][col])) pivot = r;
    }
    if (!(std::abs(a[pivot][col]) > 1e-12)) return false;
    std::swap(a[col], a[pivot]);
    std::swap(b[col], b[pivot]);
    for (size_t r = col + 1; r < n; ++r) {
      const double f = a[r][col] / a[col][col];
      for (size_t c = col; c < n; ++c) a[r][c] -= f * a[col][c];
      b[r] -= f * b[col];
    }
  }
  x.assign(n, 0.0);
  for (size_t i = n; i-- > 0;) {
    double v = b[i];
    for (size_t c = i + 1; c < n; ++c) v -= a[i][c] * x[c];
    x[i] = v / a[i][i];
  }
  return true;
}

}  // namespace

std::vector<double> fit_nonnegative_least_squares(const std::vector<std::vector<double>>& rows,
                                                  const std::vector<double>& targets) {
  if (rows.empty() || rows.size() != targets.size()) {
    throw std::invalid_argument(fmt::format("least squares: {} rows and {} targets (need as many, at least one)",
                                            rows.size(), targets.size()));
  }
  const size_t k = rows[0].size();
  if (k == 0 || k > kMaxColumns) {
    throw std::invalid_argument(fmt::format("least squares: {} columns (allowed 1 to {})", k, kMaxColumns));
  }
  for (const auto& row : rows) {
    if (row.size() != k) throw std::invalid_argument("least squares: rows differ in width");
  }
  std::vector<double> norm(k, 0.0);
  for (const auto& row : rows)
    for (size_t c = 0; c < k; ++c) norm[c] += row[c] * row[c];
  for (double& n : norm) n = n > 0 ? std::sqrt(n) : 1.0;

  auto residual = [&](const std::vector<double>& x) {
    double sum = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      double r = -targets[i];
      for (size_t c = 0; c < k; ++c) r += rows[i][c] * x[c];
      sum += r * r;
    }
    return sum;
  };
  std::vector<double> best(k, 0.0);
  double best_residual = residual(best);
  for (uint32_t mask = 1; mask < (1u << k); ++mask) {
    std::vector<size_t> cols;
    for (size_t c = 0; c < k; ++c) {
      if (mask & (1u << c)) cols.push_back(c);
    }
    const size_t m = cols.size();
    std::vector<std::vector<double>> ata(m, std::vector<double>(m, 0.0));
    std::vector<double> atb(m, 0.0);
    for (size_t i = 0; i < rows.size(); ++i) {
      for (size_t a = 0; a < m; ++a) {
        const double va = rows[i][cols[a]] / norm[cols[a]];
        atb[a] += va * targets[i];
        for (size_t b = 0; b < m; ++b) ata[a][b] += va * rows[i][cols[b]] / norm[cols[b]];
      }
    }
    std::vector<double> z;
    if (!solve(ata, atb, z)) continue;
    if (std::any_of(z.begin(), z.end(), [](double v) { return v < 0; })) continue;
    std::vector<double> x(k, 0.0);
    for (size_t a = 0; a < m; ++a) x[cols[a]] = z[a] / norm[cols[a]];
    const double r = residual(x);
    if (r < best_residual) {
      best_residual = r;
      best = x;
    }
  }
  return best;
}

}  // namespace dcp
