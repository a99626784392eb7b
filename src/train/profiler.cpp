#include "dcp/profiler.h"
#include "util/file_write.h"

#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <stdexcept>
#include <thread>

#include "dcp/data.h"
#include "dcp/memory_meter.h"
#include "dcp/model.h"
#include "dcp/planning.h"
#include "dcp/precision.h"
#include "util/stats.h"

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

// Printable ASCII, so that the corpus keeps every document (no NUL, valid UTF-8).
std::string random_text(int64_t length, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> byte(32, 126);
  std::string s(static_cast<size_t>(length), ' ');
  for (char& c : s) c = static_cast<char>(byte(rng));
  return s;
}

double max_rss_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) * 1024.0;  // Linux reports kilobytes
}

double physical_memory_bytes() {
  return static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
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

namespace {

// Sum of squared sample lengths of a point, tokens^2.
double squares(const ProfilePoint& p) {
  double q = 0;
  for (int64_t len : p.lengths) q += static_cast<double>(len) * static_cast<double>(len);
  return q;
}

// The memory fit of profile_model (its doc comment): relative residuals over the points not held out.
void fit_memory(ProfileResult& result) {
  const double L = static_cast<double>(result.shape.layers);
  // Only operators that materialise per-sample score matrices get the s^2 terms; for the tiled softmax and the
  // chunked linear forms they would only fit noise.
  const ModelShape& shape = result.shape;
  const bool quadratic = shape.attention == AttentionKind::kSoftmaxReference ||
                         (shape.attention == AttentionKind::kLinear && shape.chunk_size == 0);
  std::vector<std::vector<double>> rows;
  std::vector<double> targets;
  for (const ProfilePoint& p : result.points) {
    if (p.held_out) continue;
    const double t = static_cast<double>(p.tokens), q = squares(p), r = static_cast<double>(p.recompute_layers);
    const double m = p.measured_peak_bytes;
    rows.push_back({1.0 / m, t * (L - r) / m, t * r / m});
    if (quadratic) {
      rows.back().push_back(q * (L - r) / m);
      rows.back().push_back(q / m);
    }
    targets.push_back(1.0);
  }
  std::vector<double> x = fit_nonnegative_least_squares(rows, targets);
  x.resize(5, 0.0);
  if (!(x[1] > 0 || x[2] > 0)) {
    throw std::runtime_error(fmt::format(
        "profile: the memory fit found no bytes per token (measured peaks, by the {}, do not grow with the "
        "micro-batch)",
        result.memory_method));
  }
  MemoryCoefficients& c = result.memory;
  c.base_bytes = x[0];
  c.token_layer_bytes = x[1];
  c.token_recompute_bytes = x[2];
  c.token_bytes = 0;  // not separable from a and b: c t = (c / L) (t (L - r) + t r)
  c.square_layer_bytes = x[3];
  c.square_bytes = x[4];
  // Not measurable in one process: the q, k, v stack and send copy of Ulysses (MemoryCoefficients).
  c.sp_token_bytes = 6.0 * static_cast<double>(result.shape.hidden * result.shape.bytes_per_element);

  const MemoryModel fitted(result.shape, c, result.device.memory_bytes);
  std::vector<double> heldout_errors, fit_errors;
  for (ProfilePoint& p : result.points) {
    p.predicted_peak_bytes = fitted.bytes(p.lengths, 1, p.recompute_layers);
    const double err = std::abs(p.predicted_peak_bytes - p.measured_peak_bytes) / p.measured_peak_bytes;
    (p.held_out ? heldout_errors : fit_errors).push_back(err);
  }
  result.memory_heldout_median_error = median(heldout_errors);
  result.memory_heldout_max_error =
      heldout_errors.empty() ? 0.0 : *std::max_element(heldout_errors.begin(), heldout_errors.end());
  result.memory_fit_median_error = median(fit_errors);
}

}  // namespace

ProfileResult profile_model(const Config& cfg, const ProfileOptions& options) {
  if (options.repeats < 1) {
    throw std::invalid_argument(fmt::format("profile: repeats {} must be >= 1", options.repeats));
  }
  std::vector<int64_t> lengths;
  for (int64_t len : options.sample_lengths) {
    if (len >= 1 && len <= cfg.data.max_seq_len) lengths.push_back(len);
  }
  if (lengths.empty() || options.micro_batch_tokens.empty()) {
    throw std::invalid_argument(fmt::format("profile: no grid sample length fits data.max_seq_len {} (or no "
                                            "micro-batch token target)",
                                            cfg.data.max_seq_len));
  }

  ProfileResult result;
  const Precision precision = resolve_precision(cfg.train.precision).precision;
  result.shape = model_shape_of(cfg, activation_bytes(precision));
  result.repeats = options.repeats;
  result.threads = cfg.train.threads > 0 ? cfg.train.threads
                                         : std::max<int64_t>(1, std::thread::hardware_concurrency());
  torch::set_num_threads(static_cast<int>(result.threads));
  torch::manual_seed(cfg.run.seed);
  Transformer model(cfg.model, cfg.attention, precision);
  model->train();
  const CostModel flop_model(result.shape, DeviceSpec{});
  // The trainer's resident state during forward+backward: weights, gradients (zeroed in place between runs
  // here) and AdamW's two moments per parameter.
  result.memory_method = MemoryMeter::install();
  std::vector<torch::Tensor> optimizer_state;
  for (auto& p : model->parameters()) {
    p.mutable_grad() = torch::zeros_like(p);
    optimizer_state.push_back(torch::zeros_like(p));
    optimizer_state.push_back(torch::zeros_like(p));
  }

  // The grid: per length, the (tokens, recompute) combinations rotated by the length's index.
  struct Combo {
    int64_t tokens, recompute;
  };
  std::vector<Combo> combos;
  for (int64_t t : options.micro_batch_tokens)
    for (int64_t r : {int64_t{0}, cfg.model.n_layers}) combos.push_back({t, r});
  for (size_t li = 0; li < lengths.size(); ++li) {
    for (size_t j = 0; j < combos.size(); ++j) {
      const Combo& c = combos[(j + li) % combos.size()];
      ProfilePoint p;
      p.lengths.assign(static_cast<size_t>(std::max<int64_t>(1, c.tokens / lengths[li])), lengths[li]);
      p.tokens = lengths[li] * static_cast<int64_t>(p.lengths.size());
      p.recompute_layers = c.recompute;
      p.flops = flop_model.flops(p.lengths, p.recompute_layers);
      p.held_out = result.points.size() % 4 == 3;
      result.points.push_back(std::move(p));
    }
  }

  std::mt19937_64 rng(static_cast<uint64_t>(cfg.run.seed));
  for (ProfilePoint& p : result.points) {
    std::vector<std::pair<std::string, std::string>> docs;
    std::vector<int64_t> ids;
    for (size_t i = 0; i < p.lengths.size(); ++i) {
      docs.emplace_back(fmt::format("profile{}", i), random_text(p.lengths[i], rng));
      ids.push_back(static_cast<int64_t>(i));
    }
    const Corpus corpus = Corpus::from_documents(docs, cfg.data);
    const PackedBatch batch = make_batch(corpus, ids);
    std::vector<double> times;
    for (int64_t run = 0; run <= options.repeats; ++run) {
      model->zero_grad();  // set_to_none false: the gradients stay allocated, as after a trainer's micro-batch
      MemoryMeter::reset_peak();
      const auto start = std::chrono::steady_clock::now();
      model->loss_sum(batch, p.recompute_layers).backward();
      const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
      if (run == 0) continue;  // the warm-up
      times.push_back(elapsed.count());
      p.measured_peak_bytes = std::max(p.measured_peak_bytes, static_cast<double>(MemoryMeter::peak_bytes()));
    }
    p.measured_s = median(times);
  }

  std::vector<std::vector<double>> rows;
  std::vector<double> targets;
  for (const ProfilePoint& p : result.points) {
    if (p.held_out) continue;
    rows.push_back({1.0 / p.measured_s, p.flops.linear / p.measured_s, p.flops.attention / p.measured_s});
    targets.push_back(1.0);
  }
  std::vector<double> coef = fit_nonnegative_least_squares(rows, targets);
  result.attention_separated = coef[2] > 0;
  if (!result.attention_separated) {
    // The grid does not separate attention from the linear terms: one rate for all FLOPs.
    for (auto& row : rows) row = {row[0], row[1] + row[2]};
    const std::vector<double> joint = fit_nonnegative_least_squares(rows, targets);
    coef = {joint[0], joint[1], joint[1]};
  }
  if (!(coef[1] > 0)) {
    throw std::runtime_error(
        "profile: the fit found no cost per FLOP (measured times do not grow with the micro-batch's FLOPs); "
        "rerun with more repeats on an idle machine");
  }
  result.fixed_s = coef[0];
  result.linear_flops_per_s = 1.0 / coef[1];
  result.attention_flops_per_s = 1.0 / coef[2];

  DeviceSpec& d = result.device;
  d.name = "cpu-profile";
  d.peak_flops = result.linear_flops_per_s;
  d.mfu = 1.0;
  d.attention_mfu = result.attention_flops_per_s / result.linear_flops_per_s;
  d.micro_batch_overhead_s = result.fixed_s;
  d.memory_bytes = physical_memory_bytes();
  d.gpus_per_node = 1;

  const CostModel fitted(result.shape, d);
  std::vector<double> heldout_errors, fit_errors;
  for (ProfilePoint& p : result.points) {
    p.predicted_s = fitted.seconds(p.lengths, 1, p.recompute_layers);
    const double err = std::abs(p.predicted_s - p.measured_s) / p.measured_s;
    (p.held_out ? heldout_errors : fit_errors).push_back(err);
  }
  result.heldout_median_error = median(heldout_errors);
  result.heldout_max_error =
      heldout_errors.empty() ? 0.0 : *std::max_element(heldout_errors.begin(), heldout_errors.end());
  result.fit_median_error = median(fit_errors);
  fit_memory(result);
  result.max_rss_bytes = max_rss_bytes();
  return result;
}

void write_profile(const ProfileResult& r, const std::string& path) {
  const DeviceSpec& d = r.device;
  nlohmann::json grid = nlohmann::json::array();
  for (const ProfilePoint& p : r.points) {
    grid.push_back({{"sample_length", p.lengths.front()},
                    {"samples", p.lengths.size()},
                    {"tokens", p.tokens},
                    {"recompute_layers", p.recompute_layers},
                    {"linear_flops", p.flops.linear},
                    {"attention_flops", p.flops.attention},
                    {"measured_s", p.measured_s},
                    {"predicted_s", p.predicted_s},
                    {"measured_peak_bytes", p.measured_peak_bytes},
                    {"predicted_peak_bytes", p.predicted_peak_bytes},
                    {"held_out", p.held_out}});
  }
  const nlohmann::json doc = {
      {"device",
       {{"name", d.name},
        {"memory_bytes", d.memory_bytes},
        {"peak_flops", d.peak_flops},
        {"mfu", d.mfu},
        {"attention_mfu", d.attention_mfu},
        {"intra_node_bw", d.intra_node_bw},
        {"inter_node_bw", d.inter_node_bw},
        {"gpus_per_node", d.gpus_per_node},
        {"collective_latency_s", d.collective_latency_s},
        {"micro_batch_overhead_s", d.micro_batch_overhead_s}}},
      {"model",
       {{"hidden", r.shape.hidden},
        {"layers", r.shape.layers},
        {"heads", r.shape.heads},
        {"ffn", r.shape.ffn},
        {"mlp_matrices", r.shape.mlp_matrices},
        {"vocab", r.shape.vocab},
        {"bytes_per_element", r.shape.bytes_per_element},
        {"precision", precision_of_bytes(r.shape.bytes_per_element)},
        {"attention", attention_kind_name(r.shape.attention)},
        {"feature_dim", r.shape.feature_dim},
        {"feature_projections", r.shape.feature_projections},
        {"chunk_size", r.shape.chunk_size}}},
      {"fit",
       {{"formula", "seconds = fixed_s + linear_flops / linear_flops_per_s + attention_flops / attention_flops_per_s"},
        {"weighting", "relative residuals (each point divided by its measured seconds), coefficients >= 0"},
        {"fixed_s", r.fixed_s},
        {"linear_flops_per_s", r.linear_flops_per_s},
        {"attention_flops_per_s", r.attention_flops_per_s},
        {"attention_separated", r.attention_separated},
        {"heldout_median_rel_error", r.heldout_median_error},
        {"heldout_max_rel_error", r.heldout_max_error},
        {"fit_median_rel_error", r.fit_median_error}}},
      {"memory",
       {{"formula", "bytes = base_bytes + t * (token_layer_bytes * (L - r) + token_recompute_bytes * r + token_bytes "
                    "+ [sp > 1] sp_token_bytes) + Q * (square_layer_bytes * (L - r) + square_bytes); t = tokens / sp, "
                    "Q = sum of squared sample lengths / sp, L layers, r recomputed"},
        {"weighting", "relative residuals (each point divided by its measured peak bytes), coefficients >= 0"},
        {"method", r.memory_method},
        {"base_bytes", r.memory.base_bytes},
        {"token_layer_bytes", r.memory.token_layer_bytes},
        {"token_recompute_bytes", r.memory.token_recompute_bytes},
        {"token_bytes", r.memory.token_bytes},
        {"square_layer_bytes", r.memory.square_layer_bytes},
        {"square_bytes", r.memory.square_bytes},
        {"sp_token_bytes", r.memory.sp_token_bytes},
        {"heldout_median_rel_error", r.memory_heldout_median_error},
        {"heldout_max_rel_error", r.memory_heldout_max_error},
        {"fit_median_rel_error", r.memory_fit_median_error}}},
      {"grid", grid},
      {"threads", r.threads},
      {"repeats", r.repeats},
      {"max_rss_bytes", r.max_rss_bytes},
      {"notes",
       {"memory: peak bytes of tensor storage per run (memory.method; the fallback is the process high-water "
        "mark), with weights, gradients and AdamW moments resident as in the trainer; token_bytes is 0 because it "
        "is not separable from token_layer_bytes and token_recompute_bytes; the division by sp and sp_token_bytes "
        "= 6 hidden bytes_per_element are assumed (sp 1 only is measured); max_rss_bytes is the process "
        "high-water mark after the run",
        "sequence parallelism is not profiled: intra_node_bw, inter_node_bw and collective_latency_s are the "
        "DeviceSpec defaults"}}};
  write_file_checked(path, doc.dump(1) + "\n");
}

}  // namespace dcp
