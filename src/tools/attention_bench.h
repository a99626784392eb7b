// `dcp bench-attention`: forward and backward seconds, useful FLOP rate and peak bytes of one layer's attention
// operator (the tiled softmax, its [L, L] reference twin and the Flexformer variants, docs/flexformer.md) on one
// sequence of growing length, on this process's CPU.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "dcp/linear_attention.h"

namespace dcp {

/// The operators compared: "softmax" (SoftmaxAttention, the tiled operator), "softmax-reference" (its per-sample
/// [L, L] twin), the flexformer feature maps "stationary", "nonstationary", "fixed" and "elu" on the fused kernel
/// (attention.linear_impl fused) and the same four as "<map>-reference" on their autograd twin (linear_impl
/// reference, the chunked form), in this order.
const std::vector<std::string>& attention_bench_variants();

/// The input dtypes bench_attention takes: "fp32" and "bf16".
const std::vector<std::string>& attention_bench_dtypes();

/// Bytes per element of a dtype of attention_bench_dtypes() (4, 2). Throws std::invalid_argument naming it
/// otherwise.
int64_t attention_bench_element_bytes(const std::string& dtype);

/// What bench_attention measures. Every flexformer variant uses the chunked form with `chunk_size` and the
/// given input_norm / normalizer (attention.* values, docs/config.md); the tiled softmax uses tile_q x tile_k.
struct AttentionBenchOptions {
  std::vector<int64_t> lengths;        ///< tokens of the one sequence, measured in this order (ascending)
  std::vector<std::string> variants;   ///< names from attention_bench_variants()
  std::string dtype = "fp32";          ///< of q, k, v and the output gradient g: "fp32" or "bf16"
  int64_t heads = 4;
  int64_t head_dim = 32;
  int64_t num_features = 64;           ///< m, frequencies per head
  int64_t chunk_size = 64;             ///< tokens per chunk of the chunked form
  std::string input_norm = "l2";
  std::string normalizer = "shift";
  int64_t tile_q = 64;                 ///< queries per tile of the tiled softmax (attention.tile_q)
  int64_t tile_k = 128;                ///< keys per tile (attention.tile_k)
  int64_t repetitions = 3;             ///< timed runs per point after one warm-up; the point's time is their median
  double max_bytes = 0;                ///< points whose predicted peak exceeds this are skipped, bytes
  /// Once one run of a variant takes longer, its remaining repetitions and longer lengths are skipped, seconds.
  double max_seconds = 0;
  uint64_t seed = 1234;                ///< seeds q, k, v, the output gradient and the flexformer frequencies
};

/// The useful FLOPs of one forward and one backward of an operator on one sequence.
struct AttentionFlops {
  double forward = 0;   ///< FLOPs
  double backward = 0;  ///< FLOPs
  /// "causal" (the softmax variants: the products a causal FlashAttention-2 kernel needs) or "cost model"
  /// (the flexformer variants: CostModel's count of the chunked form).
  std::string source;
};

/// FLOPs credited to `variant` on one sequence of `length` tokens with o's heads H, head_dim D and flexformer
/// settings. softmax and softmax-reference alike: the causal products only, forward 4 (L^2 / 2) D H (QK^T and
/// PV over the lower triangle) and backward 2.5x that (five products instead of two; FlashAttention-2, Dao
/// 2023), so fwd+bwd = 3.5 * 2 L^2 D H; the reference multiplies the whole square, and the credit stays the
/// causal work so that both rates count the same useful work. Flexformer: A(L), the forward FLOPs of the chunked
/// form that CostModel counts (dcp/cost_model.h, with the shape with_attention builds from these settings), and
/// backward 2 A(L). Throws std::invalid_argument for an unknown variant or a length < 1.
AttentionFlops attention_bench_flops(const AttentionBenchOptions& o, const std::string& variant, int64_t length);

/// Bytes an exact attention operator must read or write on one sequence: q, k, v, out, the output gradient g,
/// dq, dk and dv (8 tensors [length, heads, head_dim] of element_bytes each) plus the [length, heads] fp32
/// logsumexp. The yardstick of the memory ratio (dcp/attention_bench_report: peak of everything held / this).
double attention_io_bytes(int64_t length, int64_t heads, int64_t head_dim, int64_t element_bytes);

/// One (variant, length) point: measured, or skipped with the reason.
struct AttentionBenchPoint {
  std::string variant;
  std::string dtype;            ///< of q, k, v, g ("fp32", "bf16")
  int64_t length = 0;
  bool measured = false;
  /// Set when !measured, e.g. "needs 17.2 GB > --max-bytes 12.0 GB" or "allocation failed: <LibTorch's message>".
  std::string skip_reason;
  double forward_seconds = 0;   ///< median forward seconds of the timed runs (runs 0: of the warm-up)
  double backward_seconds = 0;  ///< median backward seconds
  double seconds = 0;           ///< median forward+backward seconds (of each run's sum)
  /// Timed runs behind the medians: fewer than repetitions once one ran past max_seconds, 0 when the warm-up did.
  int64_t runs = 0;
  AttentionFlops flops;         ///< attention_bench_flops of the point (set for skipped points too)
  /// Largest peak over the timed runs (or the warm-up) of the forward+backward, above the bytes resident before.
  double peak_bytes = 0;
  /// Bytes of the inputs resident during the run: q, k, v, g and the backend's parameters.
  double input_bytes = 0;
  double io_bytes = 0;          ///< attention_io_bytes of the point (set for skipped points too)
  /// tiled_attention_peak_bytes for softmax, softmax_attention_peak_bytes for softmax-reference,
  /// fused_flexformer_peak_bytes for the flexformer variants, flexformer_attention_peak_bytes for their twins.
  double predicted_bytes = 0;
};

/// Predicted peak bytes of tensor storage that one forward+backward of the tiled softmax operator on one
/// sequence of `length` tokens allocates beyond its inputs (q, k, v, g of element_bytes each), linear in
/// length: 4 token copies [length, heads, head_dim] in the input dtype (out, dq, dk, dv), the fp32 [length,
/// heads] logsumexp and per thread the backward's workspace over the whole sequence of one head plus its tiles
/// (of tile_q x tile_k: scores, their gradient, their operand copies, the key tile's packs): fp32 q^T, dout^T and dq accumulator (12 length head_dim bytes), or on AMX tiles (bf16, amx_tiles)
/// bf16 q^T and dout^T with the fp32 accumulator (8 length head_dim bytes, head_dim padded to a multiple of 32). For bf16 where the AMX tiles do not
/// run (amx_tiles false: no AMX, or an odd head_dim) the operator computes on fp32 copies and peaks inside that
/// pass: the bf16 out, 8 fp32 token copies (q, k, v, out, dout and three fp32 gradients; the bf16 gradients are
/// cast after it) and the fp32 workspace. Measured within 5% at 1 and 2 threads (4 heads x 32 and 64, 512..4K
/// tokens, Sapphire Rapids) and, for the fp32-copy path, within 1% (1 thread, 2 and 4 heads x 32, 1K and 2K
/// tokens, AMD EPYC). Throws std::invalid_argument for an element_bytes other than 2 or 4.
double tiled_attention_peak_bytes(int64_t length, int64_t heads, int64_t head_dim, int64_t threads,
                                  int64_t element_bytes = 4, bool amx_tiles = true, int64_t tile_q = 64,
                                  int64_t tile_k = 128);

/// Predicted peak bytes of tensor storage that one forward+backward of the reference softmax on one sequence of
/// `length` tokens allocates beyond its inputs, an upper bound: three [heads, L, L] fp32 score-sized tensors
/// alive at once (during the softmax backward: the saved probabilities, their gradient and the scores'
/// gradient; fp32 for bf16 inputs too, which the reference upcasts), the two [L, L] bool masks, and 4 fp32 token
/// copies (the upcast q, k, v, out and their gradients), plus for bf16 4 in bf16 (the results cast back). Used
/// to skip lengths that do not fit; test_attention_bench checks it against the measured peak. Throws
/// std::invalid_argument for an element_bytes other than 2 or 4.
double softmax_attention_peak_bytes(int64_t length, int64_t heads, int64_t head_dim, int64_t element_bytes = 4);

/// Predicted peak bytes of tensor storage that one forward+backward of the chunked FlexformerAttention's autograd
/// twin (the "-reference" variants) on one
/// sequence of `length` tokens allocates beyond its inputs, linear in length: per token and head, 9
/// [feature_dim] fp32 feature-sized tensors (the projections, their cos / sin, phi(q), phi(k) and their
/// gradients), 2 intra-chunk score rows of min(chunk_size, length) (the masked scores and their gradient), 3
/// chunk states [feature_dim, head_dim + 1] shared by chunk_size tokens (the chunk sums, the carried states,
/// their gradient) and 8 fp32 token copies of head_dim, 3 more for bf16 inputs (the operator computes in fp32
/// whatever the input dtype: their fp32 copies). feature_dim is FlexformerAttention::feature_dim() (2m or
/// head_dim, + 1 for the shift normalizer). Fitted to the measured peaks of the four feature maps (about 28 KB
/// per token at 4 heads x 32, m 64, chunk 64, fp32); test_attention_bench checks it within a factor. Throws
/// std::invalid_argument for an element_bytes other than 2 or 4.
double flexformer_attention_peak_bytes(int64_t length, int64_t heads, int64_t head_dim, int64_t feature_dim,
                                       int64_t chunk_size, int64_t element_bytes = 4);

/// Predicted peak bytes of tensor storage that one forward+backward of FlexformerAttention on the fused kernel
/// allocates beyond its inputs, linear in length: 4 token copies [length, heads, head_dim] in the input dtype (out,
/// dq, dk, dv), the [length, heads] fp32 denominators and, without `gain`, their gradients (the backward's
/// buffer), for bf16 one more token copy (the output's rounding residual), with `gain` (normalizer none) the gain's
/// product and its gradient in fp32 (and for bf16 the product's bf16 cast), and per thread the kernel's workspace
/// (fused_linear_attention_workspace_bytes, dcp/linear_attention.h). test_attention_bench checks it against the
/// measured peak. Throws std::invalid_argument for an element_bytes other than 2 or 4.
double fused_flexformer_peak_bytes(int64_t length, int64_t heads, int64_t head_dim, int64_t threads,
                                   int64_t element_bytes, FeatureMap map, int64_t num_features, int64_t chunk_size,
                                   bool gain = false);

/// Measures every variant over every length: q, k, v [L, heads, head_dim] ~ N(0, 1) in o.dtype requiring grad,
/// cu_seqlens {0, L}; a run is the backend's forward, then torch::autograd::backward({out}, {g}) with a fixed
/// g ~ N(0, 1) of out's shape and dtype (no product with g enters the measurement), which also computes the
/// flexformer parameters' gradients (the parameters stay fp32), each timed with std::chrono::steady_clock. The
/// peak is MemoryMeter::peak_bytes() minus the bytes resident before the run (inputs, parameters); gradients are
/// dropped between runs. Uses torch's current intra-op thread count. Skips (never drops) a point: when its
/// predicted peak (the three *_peak_bytes above, for o.dtype) > max_bytes, when a run's allocation fails
/// (c10::Error of the allocator, std::bad_alloc; reason "allocation failed: <message>"), and every length of a
/// variant after one of its runs (the warm-up included) exceeded max_seconds or failed to allocate. Lengths are
/// the outer loop, variants the inner one, so that load drift hits all variants at a length alike; `on_point`
/// is called after each point. The result is sorted variant by variant (in `variants` order), lengths ascending.
/// Throws std::invalid_argument naming the option for an unknown variant or dtype, a length < 1, or heads,
/// head_dim, repetitions < 1, and ConfigError for a bad input_norm / normalizer / num_features / chunk_size.
std::vector<AttentionBenchPoint> bench_attention(
    const AttentionBenchOptions& options,
    const std::function<void(const AttentionBenchPoint&)>& on_point = nullptr);

}  // namespace dcp
