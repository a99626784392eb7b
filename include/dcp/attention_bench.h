// `dcp bench-attention`: forward+backward seconds and peak bytes of one layer's attention operator (softmax and
// the Flexformer variants, docs/flexformer.md) on one sequence of growing length, on this process's CPU.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dcp {

/// The operators compared: "softmax" (SoftmaxAttention, the tiled operator), "softmax-reference" (its per-sample
/// [L, L] twin) and the flexformer feature maps "stationary", "nonstationary", "fixed" and "elu", in this order.
const std::vector<std::string>& attention_bench_variants();

/// What bench_attention measures. Every flexformer variant uses the chunked form with `chunk_size` and the
/// given input_norm / normalizer (attention.* values, docs/config.md).
struct AttentionBenchOptions {
  std::vector<int64_t> lengths;        ///< tokens of the one sequence, measured in this order (ascending)
  std::vector<std::string> variants;   ///< names from attention_bench_variants()
  int64_t heads = 4;
  int64_t head_dim = 32;
  int64_t num_features = 64;           ///< m, frequencies per head
  int64_t chunk_size = 64;             ///< tokens per chunk of the chunked form
  std::string input_norm = "l2";
  std::string normalizer = "shift";
  int64_t repetitions = 3;             ///< timed runs per point after one warm-up; the point's time is their median
  double max_bytes = 0;                ///< points whose predicted peak exceeds this are skipped, bytes
  /// Once one run of a variant takes longer, its remaining repetitions and longer lengths are skipped, seconds.
  double max_seconds = 0;
  uint64_t seed = 1234;                ///< seeds q, k, v, the output gradient and the flexformer frequencies
};

/// One (variant, length) point: measured, or skipped with the reason.
struct AttentionBenchPoint {
  std::string variant;
  int64_t length = 0;
  bool measured = false;
  /// Set when !measured, e.g. "needs 17.2 GB > --max-bytes 12.0 GB" or "allocation failed: <LibTorch's message>".
  std::string skip_reason;
  double seconds = 0;           ///< median forward+backward seconds of the timed runs (runs 0: of the warm-up)
  /// Timed runs behind `seconds`: fewer than repetitions once one ran past max_seconds, 0 when the warm-up did.
  int64_t runs = 0;
  double peak_bytes = 0;        ///< largest peak over the timed runs (or the warm-up), above the bytes resident before
  /// softmax_attention_peak_bytes for softmax, flexformer_attention_peak_bytes for the flexformer variants.
  double predicted_bytes = 0;
};

/// Predicted peak bytes of tensor storage that one forward+backward of the tiled softmax operator on one fp32
/// sequence of `length` tokens allocates beyond its inputs, linear in length: 6 token copies of [heads, head_dim]
/// (out, out * g and its gradient, dq, dk, dv), the [L, heads] logsumexp, and per thread the backward's workspace
/// (q^T, dout^T and the fp32 dq accumulator of one head, 3 L head_dim floats, plus 64 KB of tiles).
double tiled_attention_peak_bytes(int64_t length, int64_t heads, int64_t head_dim, int64_t threads);

/// Predicted peak bytes of tensor storage that one forward+backward of the reference softmax on one fp32 sequence of
/// `length` tokens allocates beyond its inputs: three [heads, L, L] fp32 score-sized tensors alive at once
/// (during the softmax backward: the saved probabilities, their gradient and the scores' gradient), the two
/// [L, L] bool masks, and the token-linear terms (q, k, v copies and gradients). Used to skip lengths that do not
/// fit; test_attention_bench checks it against the measured peak.
double softmax_attention_peak_bytes(int64_t length, int64_t heads, int64_t head_dim);

/// Predicted peak bytes of tensor storage that one forward+backward of the chunked FlexformerAttention on one
/// fp32 sequence of `length` tokens allocates beyond its inputs, linear in length: per token and head, 9
/// [feature_dim] fp32 feature-sized tensors (the projections, their cos / sin, phi(q), phi(k) and their
/// gradients), 2 intra-chunk score rows of min(chunk_size, length) (the masked scores and their gradient), 3
/// chunk states [feature_dim, head_dim + 1] shared by chunk_size tokens (the chunk sums, the carried states,
/// their gradient) and 8 token copies of head_dim as softmax. feature_dim is FlexformerAttention::feature_dim()
/// (2m or head_dim, + 1 for the shift normalizer). Fitted to the measured peaks of the four feature maps
/// (about 28 KB per token at 4 heads x 32, m 64, chunk 64); test_attention_bench checks it within a factor.
double flexformer_attention_peak_bytes(int64_t length, int64_t heads, int64_t head_dim, int64_t feature_dim,
                                       int64_t chunk_size);

/// Measures every variant over every length: q, k, v [L, heads, head_dim] fp32 ~ N(0, 1) requiring grad,
/// cu_seqlens {0, L}; a run is the backend's forward and the backward of sum(out * g) with a fixed g ~ N(0, 1),
/// which also computes the flexformer parameters' gradients, timed with std::chrono::steady_clock. The peak is
/// MemoryMeter::peak_bytes() minus the bytes resident before the run (inputs, parameters); gradients are
/// dropped between runs. Uses torch's current intra-op thread count. Skips (never drops) a point: when its
/// predicted peak (softmax_attention_peak_bytes, flexformer_attention_peak_bytes) > max_bytes, when a run's
/// allocation fails (c10::Error of the allocator, std::bad_alloc; reason "allocation failed: <message>"), and
/// every length of a variant after one of its runs (the warm-up included) exceeded max_seconds or failed to
/// allocate. Lengths are the outer loop, variants the inner one, so that load drift hits
/// all variants at a length alike; `on_point` is called after each point. The result is sorted variant by
/// variant (in `variants` order), lengths ascending.
/// Throws std::invalid_argument naming the option for an unknown variant, a length < 1, or heads, head_dim,
/// repetitions < 1, and ConfigError for a bad input_norm / normalizer / num_features / chunk_size.
std::vector<AttentionBenchPoint> bench_attention(
    const AttentionBenchOptions& options,
    const std::function<void(const AttentionBenchPoint&)>& on_point = nullptr);

}  // namespace dcp
