#include "tools/attention_bench.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <stdexcept>

#include "dcp/cost_model.h"
#include "dcp/cpu_features.h"
#include "dcp/flexformer.h"
#include "dcp/memory_meter.h"
#include "dcp/model.h"
#include "dcp/planning.h"
#include "util/clock.h"
#include "util/error_message.h"
#include "util/stats.h"

namespace dcp {
namespace {

bool is_softmax(const std::string& variant) { return variant == "softmax" || variant == "softmax-reference"; }

constexpr const char* kReferenceSuffix = "-reference";

// "elu-reference" -> true (the autograd twin of a flexformer variant).
bool is_twin(const std::string& variant) {
  const std::string suffix = kReferenceSuffix;
  return !is_softmax(variant) && variant.size() > suffix.size() &&
         variant.compare(variant.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// The feature map of a flexformer variant ("elu-reference" -> "elu").
std::string feature_map_of(const std::string& variant) {
  return is_twin(variant) ? variant.substr(0, variant.size() - std::string(kReferenceSuffix).size()) : variant;
}

// The attention.* settings that make `variant`: the model's own backend factory builds it, and the cost model's
// FLOP count reads the same settings.
AttentionConfig attention_config_of(const std::string& variant, const AttentionBenchOptions& o) {
  AttentionConfig cfg;
  cfg.backend = is_softmax(variant) ? "softmax" : "flexformer";
  cfg.impl = variant == "softmax-reference" ? "reference" : "tiled";
  cfg.linear_impl = is_twin(variant) ? "reference" : "fused";
  cfg.tile_q = o.tile_q;
  cfg.tile_k = o.tile_k;
  cfg.feature_map = feature_map_of(variant);
  cfg.num_features = o.num_features;
  cfg.chunk_size = o.chunk_size;
  cfg.input_norm = o.input_norm;
  cfg.normalizer = o.normalizer;
  cfg.mode = "chunk";
  return cfg;
}

std::shared_ptr<AttentionBackend> make_backend(const std::string& variant, const AttentionBenchOptions& o) {
  ModelConfig model;
  model.n_heads = o.heads;
  model.d_model = o.heads * o.head_dim;
  return make_attention_backend(attention_config_of(variant, o), model);
}

std::vector<torch::Tensor> parameters_of(const AttentionBackend& backend) {
  const auto* module = dynamic_cast<const torch::nn::Module*>(&backend);
  return module ? module->parameters() : std::vector<torch::Tensor>{};
}

torch::ScalarType scalar_type_of(const std::string& dtype) {
  return dtype == "bf16" ? torch::kBFloat16 : torch::kFloat;
}

void check_element_bytes(const char* who, int64_t element_bytes) {
  if (element_bytes != 2 && element_bytes != 4) {
    throw std::invalid_argument(fmt::format("{}: element_bytes {} must be 2 (bf16) or 4 (fp32)", who, element_bytes));
  }
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
  const int64_t element_bytes = attention_bench_element_bytes(o.dtype);
  if (variant == "softmax") {
    // The operator's own dispatch rule (src/kernels/attention/tiled.cpp): bf16 runs on AMX tiles when the CPU
    // allows them and head_dim is even, else on fp32 copies.
    const bool amx_tiles = amx_usable() && o.head_dim % 2 == 0;
    return tiled_attention_peak_bytes(length, o.heads, o.head_dim, at::get_num_threads(), element_bytes, amx_tiles,
                                      o.tile_q, o.tile_k);
  }
  if (variant == "softmax-reference") return softmax_attention_peak_bytes(length, o.heads, o.head_dim, element_bytes);
  const auto& f = dynamic_cast<const FlexformerAttention&>(backend);
  if (is_twin(variant)) {
    return flexformer_attention_peak_bytes(length, o.heads, o.head_dim, f.feature_dim(), o.chunk_size, element_bytes);
  }
  return fused_flexformer_peak_bytes(length, o.heads, o.head_dim, at::get_num_threads(), element_bytes,
                                     f.options().feature_map, o.num_features, o.chunk_size,
                                     f.options().normalizer == Normalizer::kNone);
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
  const auto dtype = scalar_type_of(o.dtype);
  // Drawn in fp32 and rounded, so that a bf16 run sees the fp32 run's values.
  auto q = torch::randn(shape).to(dtype).requires_grad_();
  auto k = torch::randn(shape).to(dtype).requires_grad_();
  auto v = torch::randn(shape).to(dtype).requires_grad_();
  const auto g = torch::randn(shape).to(dtype);
  const auto cu_seqlens = torch::tensor(std::vector<int64_t>{0, length}, torch::kInt64);
  AttentionBenchPoint p;
  p.variant = variant;
  p.dtype = o.dtype;
  p.length = length;
  p.measured = true;
  for (const torch::Tensor& t : {q, k, v, g}) p.input_bytes += static_cast<double>(t.nbytes());
  for (const auto& param : params) p.input_bytes += static_cast<double>(param.nbytes());
  std::vector<double> forward, backward, total;
  slowest = 0;
  for (int64_t run = 0; run <= o.repetitions; ++run) {
    for (auto* t : {&q, &k, &v}) t->mutable_grad() = torch::Tensor();
    for (auto param : params) param.mutable_grad() = torch::Tensor();
    const int64_t resident = MemoryMeter::current_bytes();
    MemoryMeter::reset_peak();
    const auto start = std::chrono::steady_clock::now();
    const torch::Tensor out = backend.forward(q, k, v, cu_seqlens);
    const double forward_s = seconds_since(start);
    const auto backward_start = std::chrono::steady_clock::now();
    // g is out's gradient itself: a loss such as sum(out * g) would add its product and that product's gradient
    // to the peak, which are not the operator's.
    torch::autograd::backward({out}, {g});
    const double backward_s = seconds_since(backward_start);
    const double seconds = forward_s + backward_s;
    const double peak = static_cast<double>(MemoryMeter::peak_bytes() - resident);
    slowest = std::max(slowest, seconds);
    if (run == 0 && seconds > o.max_seconds) {
      p.forward_seconds = forward_s;
      p.backward_seconds = backward_s;
      p.seconds = seconds;
      p.peak_bytes = peak;
      return p;
    }
    if (run == 0) continue;  // the warm-up: lazy allocations, thread pool start
    forward.push_back(forward_s);
    backward.push_back(backward_s);
    total.push_back(seconds);
    p.peak_bytes = std::max(p.peak_bytes, peak);
    if (seconds > o.max_seconds) break;
  }
  p.runs = static_cast<int64_t>(total.size());
  p.forward_seconds = median(forward);
  p.backward_seconds = median(backward);
  p.seconds = median(total);
  return p;
}

}  // namespace

const std::vector<std::string>& attention_bench_variants() {
  static const std::vector<std::string> names = {"softmax",
                                                 "softmax-reference",
                                                 "stationary",
                                                 "nonstationary",
                                                 "fixed",
                                                 "elu",
                                                 "stationary-reference",
                                                 "nonstationary-reference",
                                                 "fixed-reference",
                                                 "elu-reference"};
  return names;
}

const std::vector<std::string>& attention_bench_dtypes() {
  static const std::vector<std::string> names = {"fp32", "bf16"};
  return names;
}

int64_t attention_bench_element_bytes(const std::string& dtype) {
  if (dtype == "fp32") return 4;
  if (dtype == "bf16") return 2;
  throw std::invalid_argument(fmt::format("bench_attention: unknown dtype '{}' (known: fp32, bf16)", dtype));
}

AttentionFlops attention_bench_flops(const AttentionBenchOptions& o, const std::string& variant, int64_t length) {
  const auto& known = attention_bench_variants();
  if (std::find(known.begin(), known.end(), variant) == known.end()) {
    throw std::invalid_argument(fmt::format("attention_bench_flops: unknown variant '{}'", variant));
  }
  if (length < 1) throw std::invalid_argument(fmt::format("attention_bench_flops: length {} must be >= 1", length));
  const double l = static_cast<double>(length);
  if (is_softmax(variant)) {
    constexpr double kBackwardPerForward = 2.5;
    const double forward = 4.0 * (l * l / 2) * static_cast<double>(o.head_dim * o.heads);
    return {forward, kBackwardPerForward * forward, "causal"};
  }
  ModelShape shape;
  shape.layers = 1;
  shape.heads = o.heads;
  shape.hidden = o.heads * o.head_dim;
  const CostModel cost(with_attention(shape, attention_config_of(variant, o)), DeviceSpec{});
  // CostModel counts (3 L + r) A(s): with L = 1 a recomputed layer adds exactly one forward A(s).
  const double forward = cost.flops({length}, 1).attention - cost.flops({length}, 0).attention;
  return {forward, 2 * forward, "cost model"};
}

double attention_io_bytes(int64_t length, int64_t heads, int64_t head_dim, int64_t element_bytes) {
  check_element_bytes("attention_io_bytes", element_bytes);
  const double tokens = static_cast<double>(length) * static_cast<double>(heads);
  constexpr double kTokenTensors = 8, kLseBytes = 4;
  return tokens * (kTokenTensors * static_cast<double>(head_dim * element_bytes) + kLseBytes);
}

double softmax_attention_peak_bytes(int64_t length, int64_t heads, int64_t head_dim, int64_t element_bytes) {
  check_element_bytes("softmax_attention_peak_bytes", element_bytes);
  const double l = static_cast<double>(length), h = static_cast<double>(heads), d = static_cast<double>(head_dim);
  constexpr double kScoreCopies = 3, kMaskCopies = 2, kTokenCopies = 4, kFloat = 4;
  // bf16 inputs are upcast, so the graph holds fp32 copies as for fp32, plus results cast back to bf16.
  const double token_bytes = kTokenCopies * (kFloat + (element_bytes == 2 ? 2 : 0));
  return kScoreCopies * h * l * l * kFloat + kMaskCopies * l * l + token_bytes * l * h * d;
}

double tiled_attention_peak_bytes(int64_t length, int64_t heads, int64_t head_dim, int64_t threads,
                                  int64_t element_bytes, bool amx_tiles, int64_t tile_q, int64_t tile_k) {
  check_element_bytes("tiled_attention_peak_bytes", element_bytes);
  const double l = static_cast<double>(length), h = static_cast<double>(heads), d = static_cast<double>(head_dim);
  constexpr double kTokenCopies = 4, kUpcastCopies = 8, kFloat = 4;
  const bool upcast = element_bytes == 2 && !amx_tiles;
  const bool bf16_tiles = element_bytes == 2 && amx_tiles;
  // Without AMX tiles bf16 peaks inside the fp32 pass, holding the bf16 out beside the fp32 copies; the bf16
  // gradients are cast after it.
  const double e = static_cast<double>(element_bytes);
  const double token_bytes = upcast ? kUpcastCopies * kFloat + e : kTokenCopies * e;
  // Per token and head_dim element of one head: q^T and dout^T in the tiles' operand dtype, the fp32 dq accumulator.
  // AMX tiles pad head_dim to whole 32-element rows.
  const double operand_bytes = bf16_tiles ? 2 : kFloat;
  const double padded_d = bf16_tiles ? static_cast<double>((head_dim + 31) / 32 * 32) : d;
  // The backward's tiles (src/kernels/attention/tiled.cpp, backward_pass): fp32 S, dP, dK^T, dV^T; operand
  // copies of dS (A and B), P (B), the K^T, V^T and K packs and the q and dout tiles; AMX rounds tiles to 32.
  const auto align = [&](int64_t x) { return static_cast<double>(bf16_tiles ? (x + 31) / 32 * 32 : x); };
  const double bq = align(tile_q), bk = align(tile_k), tile = bq * bk, kpack = padded_d * bk;
  const double tile_bytes = kFloat * (2 * kpack + 2 * tile) + operand_bytes * (3 * kpack + 2 * bq * padded_d + 3 * tile);
  const double workspace = static_cast<double>(threads) * ((2 * operand_bytes + kFloat) * l * padded_d + tile_bytes);
  return token_bytes * l * h * d + kFloat * l * h + workspace;
}

double flexformer_attention_peak_bytes(int64_t length, int64_t heads, int64_t head_dim, int64_t feature_dim,
                                       int64_t chunk_size, int64_t element_bytes) {
  check_element_bytes("flexformer_attention_peak_bytes", element_bytes);
  const double l = static_cast<double>(length), h = static_cast<double>(heads), d = static_cast<double>(head_dim);
  const double f = static_cast<double>(feature_dim);
  const double c = static_cast<double>(std::min(chunk_size, std::max<int64_t>(length, 1)));
  constexpr double kFeatureCopies = 9, kScoreCopies = 2, kStateCopies = 3, kTokenCopies = 8, kUpcastCopies = 3,
                   kFloat = 4;
  const double token_copies = kTokenCopies + (element_bytes == 2 ? kUpcastCopies : 0);
  return kFloat * l * h * (kFeatureCopies * f + kScoreCopies * c + kStateCopies * f * (d + 1) / c + token_copies * d);
}

double fused_flexformer_peak_bytes(int64_t length, int64_t heads, int64_t head_dim, int64_t threads,
                                   int64_t element_bytes, FeatureMap map, int64_t num_features, int64_t chunk_size,
                                   bool gain) {
  check_element_bytes("fused_flexformer_peak_bytes", element_bytes);
  const double l = static_cast<double>(length), h = static_cast<double>(heads), d = static_cast<double>(head_dim);
  const double e = static_cast<double>(element_bytes);
  constexpr double kTokenCopies = 4, kStatBytes = 4;  // out, dq, dk, dv; the [L, heads] fp32 denominators
  // bf16: the output's rounding residual; normalizer none: the gain's product and its gradient, fp32 (the gain is an
  // fp32 parameter), and for bf16 the product's cast back; with a denominator (not none) the backward's [L, heads]
  // fp32 denominator gradients (fused_linear_attention_backward).
  const double gain_bytes = gain ? 2 * 4.0 + (element_bytes == 2 ? 2.0 : 0.0) : 0.0;  // per element
  const double token_bytes = (kTokenCopies + (element_bytes == 2 ? 1 : 0)) * e * d + gain_bytes * d +
                             kStatBytes * (gain ? 1 : 2);
  const auto dtype = element_bytes == 2 ? torch::kBFloat16 : torch::kFloat;
  const double chunk = static_cast<double>(std::min(chunk_size, std::max<int64_t>(length, 1)));
  const double workspace = static_cast<double>(fused_linear_attention_workspace_bytes(
      dtype, LinearAttentionPath::kAuto, map, head_dim, num_features, static_cast<int64_t>(chunk)));
  return token_bytes * l * h + static_cast<double>(threads) * workspace;
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
  const int64_t element_bytes = attention_bench_element_bytes(o.dtype);
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
      p.dtype = o.dtype;
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
      p.flops = attention_bench_flops(o, variant, len);
      p.io_bytes = attention_io_bytes(len, o.heads, o.head_dim, element_bytes);
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
