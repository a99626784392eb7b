#include "dcp/attention_bench.h"

#include <fmt/format.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <stdexcept>

#include "dcp/flexformer.h"
#include "dcp/memory_meter.h"
#include "dcp/model.h"
#include "util/clock.h"
#include "util/error_message.h"
#include "util/stats.h"

namespace dcp {
namespace {

std::shared_ptr<AttentionBackend> make_backend(const std::string& variant, const AttentionBenchOptions& o) {
  AttentionConfig cfg;
  const bool softmax = variant == "softmax" || variant == "softmax-reference";
  cfg.backend = softmax ? "softmax" : "flexformer";
  cfg.impl = variant == "softmax-reference" ? "reference" : "tiled";
  cfg.feature_map = variant;
  cfg.num_features = o.num_features;
  cfg.chunk_size = o.chunk_size;
  cfg.input_norm = o.input_norm;
  cfg.normalizer = o.normalizer;
  cfg.mode = "chunk";
  ModelConfig model;
  model.n_heads = o.heads;
  model.d_model = o.heads * o.head_dim;
  return make_attention_backend(cfg, model);
}

std::vector<torch::Tensor> parameters_of(const AttentionBackend& backend) {
  const auto* module = dynamic_cast<const torch::nn::Module*>(&backend);
  return module ? module->parameters() : std::vector<torch::Tensor>{};
}

// A failed allocation, which skips the point instead of ending the run: c10::OutOfMemoryError, LibTorch's CPU
// allocator's c10::Error ("DefaultCPUAllocator: can't allocate memory ...") and std::bad_alloc. Any other error
// is a bug and propagates.
bool is_allocation_failure(const std::exception& e) {
  if (dynamic_cast<const std::bad_alloc*>(&e) || dynamic_cast<const c10::OutOfMemoryError*>(&e)) return true;
  return dynamic_cast<const c10::Error*>(&e) && error_message(e).find("allocate") != std::string::npos;
}

std::string first_line(const std::string& text) { return text.substr(0, text.find('\n')); }

double predicted_peak_bytes(const std::string& variant, const AttentionBackend& backend, int64_t length,
                            const AttentionBenchOptions& o) {
  if (variant == "softmax") return tiled_attention_peak_bytes(length, o.heads, o.head_dim, at::get_num_threads());
  if (variant == "softmax-reference") return softmax_attention_peak_bytes(length, o.heads, o.head_dim);
  const auto& f = dynamic_cast<const FlexformerAttention&>(backend);
  return flexformer_attention_peak_bytes(length, o.heads, o.head_dim, f.feature_dim(), o.chunk_size);
}

std::string human_bytes(double bytes) {
  if (bytes >= 1e9) return fmt::format("{:.1f} GB", bytes / 1e9);
  if (bytes >= 1e6) return fmt::format("{:.1f} MB", bytes / 1e6);
  return fmt::format("{:.0f} B", bytes);
}

// Runs the warm-up and up to `repetitions` timed runs of one point; stops early once a run (the warm-up too)
// exceeds max_seconds: a warm-up past it is the point's only time (runs 0), since the timed runs would each take
// as long. `slowest` gets the longest run, seconds.
AttentionBenchPoint measure(const AttentionBackend& backend, const std::vector<torch::Tensor>& params,
                            const std::string& variant, int64_t length, const AttentionBenchOptions& o,
                            double& slowest) {
  const auto shape = std::vector<int64_t>{length, o.heads, o.head_dim};
  auto q = torch::randn(shape).requires_grad_();
  auto k = torch::randn(shape).requires_grad_();
  auto v = torch::randn(shape).requires_grad_();
  const auto g = torch::randn(shape);
  const auto cu_seqlens = torch::tensor(std::vector<int64_t>{0, length}, torch::kInt64);
  AttentionBenchPoint p;
  p.variant = variant;
  p.length = length;
  p.measured = true;
  std::vector<double> times;
  slowest = 0;
  for (int64_t run = 0; run <= o.repetitions; ++run) {
    for (auto* t : {&q, &k, &v}) t->mutable_grad() = torch::Tensor();
    for (auto param : params) param.mutable_grad() = torch::Tensor();
    const int64_t resident = MemoryMeter::current_bytes();
    MemoryMeter::reset_peak();
    const auto start = std::chrono::steady_clock::now();
    (backend.forward(q, k, v, cu_seqlens) * g).sum().backward();
    const double seconds = seconds_since(start);
    const double peak = static_cast<double>(MemoryMeter::peak_bytes() - resident);
    slowest = std::max(slowest, seconds);
    if (run == 0 && seconds > o.max_seconds) {
      p.seconds = seconds;
      p.peak_bytes = peak;
      return p;
    }
    if (run == 0) continue;  // the warm-up: lazy allocations, thread pool start
    times.push_back(seconds);
    p.peak_bytes = std::max(p.peak_bytes, peak);
    if (seconds > o.max_seconds) break;
  }
  p.runs = static_cast<int64_t>(times.size());
  p.seconds = median(times);
  return p;
}

}  // namespace

const std::vector<std::string>& attention_bench_variants() {
  static const std::vector<std::string> names = {"softmax",       "softmax-reference", "stationary",
                                                 "nonstationary", "fixed",             "elu"};
  return names;
}

double softmax_attention_peak_bytes(int64_t length, int64_t heads, int64_t head_dim) {
  const double l = static_cast<double>(length), h = static_cast<double>(heads), d = static_cast<double>(head_dim);
  constexpr double kScoreCopies = 3, kMaskCopies = 2, kTokenCopies = 8, kFloat = 4;
  return kScoreCopies * h * l * l * kFloat + kMaskCopies * l * l + kTokenCopies * l * h * d * kFloat;
}

double tiled_attention_peak_bytes(int64_t length, int64_t heads, int64_t head_dim, int64_t threads) {
  const double l = static_cast<double>(length), h = static_cast<double>(heads), d = static_cast<double>(head_dim);
  constexpr double kTokenCopies = 6, kWorkspaceCopies = 3, kTileBytes = 64.0 * 1024, kFloat = 4;
  return kFloat * (kTokenCopies * l * h * d + l * h) +
         static_cast<double>(threads) * (kWorkspaceCopies * kFloat * l * d + kTileBytes);
}

double flexformer_attention_peak_bytes(int64_t length, int64_t heads, int64_t head_dim, int64_t feature_dim,
                                       int64_t chunk_size) {
  const double l = static_cast<double>(length), h = static_cast<double>(heads), d = static_cast<double>(head_dim);
  const double f = static_cast<double>(feature_dim);
  const double c = static_cast<double>(std::min(chunk_size, std::max<int64_t>(length, 1)));
  constexpr double kFeatureCopies = 9, kScoreCopies = 2, kStateCopies = 3, kTokenCopies = 8,
                   kFloat = 4;
  return kFloat * l * h * (kFeatureCopies * f + kScoreCopies * c + kStateCopies * f * (d + 1) / c + kTokenCopies * d);
}

std::vector<AttentionBenchPoint> bench_attention(const AttentionBenchOptions& o,
                                                 const std::function<void(const AttentionBenchPoint&)>& on_point) {
  const auto& known = attention_bench_variants();
  for (const auto& v : o.variants) {
    if (std::find(known.begin(), known.end(), v) == known.end()) {
      throw std::invalid_argument(fmt::format("bench_attention: unknown variant '{}'", v));
    }
  }
  for (int64_t len : o.lengths) {
    if (len < 1) throw std::invalid_argument(fmt::format("bench_attention: length {} must be >= 1", len));
  }
  if (o.heads < 1 || o.head_dim < 1 || o.repetitions < 1) {
    throw std::invalid_argument(fmt::format("bench_attention: heads {}, head_dim {} and repetitions {} must be >= 1",
                                            o.heads, o.head_dim, o.repetitions));
  }
  torch::manual_seed(o.seed);
  std::map<std::string, std::shared_ptr<AttentionBackend>> backends;
  for (const auto& v : o.variants) backends[v] = make_backend(v, o);

  // Lengths outer, variants inner: drift of a shared machine hits every variant at a length alike.
  std::map<std::string, std::string> stopped;  // variant -> why its longer lengths are skipped
  std::vector<AttentionBenchPoint> points;
  for (int64_t len : o.lengths) {
    for (const auto& variant : o.variants) {
      AttentionBenchPoint p;
      p.variant = variant;
      p.length = len;
      const double predicted = predicted_peak_bytes(variant, *backends[variant], len, o);
      if (stopped.count(variant)) {
        p.skip_reason = stopped[variant];
      } else if (predicted > o.max_bytes) {
        p.skip_reason = fmt::format("needs {} > --max-bytes {}", human_bytes(predicted), human_bytes(o.max_bytes));
      } else {
        double slowest = 0;
        try {
          p = measure(*backends[variant], parameters_of(*backends[variant]), variant, len, o, slowest);
          if (slowest > o.max_seconds) {
            stopped[variant] = fmt::format("a run at {} tokens took {:.1f} s > --max-seconds {:g}", len, slowest,
                                           o.max_seconds);
          }
        } catch (const std::exception& e) {
          if (!is_allocation_failure(e)) throw;
          p.skip_reason = "allocation failed: " + first_line(error_message(e));
          stopped[variant] = fmt::format("an allocation at {} tokens failed", len);
        }
      }
      p.predicted_bytes = predicted;
      if (on_point) on_point(p);
      points.push_back(p);
    }
  }
  std::stable_sort(points.begin(), points.end(), [&](const auto& a, const auto& b) {
    auto rank = [&](const std::string& v) { return std::find(o.variants.begin(), o.variants.end(), v); };
    return rank(a.variant) < rank(b.variant);
  });
  return points;
}

}  // namespace dcp
