// Analytic time and memory models of one micro-batch of a decoder transformer on a named device.
// Torch-free: planners and the simulator use them without a GPU. Sources of every formula are given next to
// it; ../shared/specs/anchors-parallel-training.md section 2 collects them.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "dcp/plan.h"

namespace dcp {

/// The attention operator of every layer, as the cost and memory models see it.
enum class AttentionKind {
  kSoftmax,  ///< exact causal softmax attention (FlashAttention-style kernels): s^2 FLOPs, memory linear in s
  /// The same operator with its [heads, s, s] scores materialised per sample (`attention.impl: reference`):
  /// the full s^2 products (no causal skipping) and s^2 memory.
  kSoftmaxReference,
  kLinear,   ///< causal (kernelised) linear attention, e.g. Flexformer: FLOPs and memory linear in s
};

/// "softmax", "softmax-reference" or "linear" (the names profile JSON files use).
const char* attention_kind_name(AttentionKind kind);

/// Shape of a dense decoder-only transformer (multi-head attention, two-matrix GELU MLP unless
/// `mlp_matrices` says otherwise). The default is a 1.3B-parameter GPT-style decoder with softmax attention.
/// The feature_dim, feature_projections and chunk_size fields describe the linear operator (docs/flexformer.md)
/// and matter only when attention is kLinear; model_shape_of (dcp/planning.h) sets them from a config.
struct ModelShape {
  int64_t hidden = 2048;
  int64_t layers = 24;
  int64_t heads = 16;
  int64_t ffn = 8192;            ///< MLP inner width
  int64_t mlp_matrices = 2;      ///< 2 for GELU (fc1, fc2), 3 for SwiGLU (gate, up, down)
  int64_t vocab = 50304;
  /// Bytes of activations, weights and gradients as the models count them: 2 = bf16 (the analytic h200 model's
  /// assumption), 4 = fp32; a profile's is the precision it measured (precision_of_bytes, dcp/precision.h).
  int64_t bytes_per_element = 2;
  AttentionKind attention = AttentionKind::kSoftmax;
  int64_t feature_dim = 0;          ///< F: features per head of phi(q), phi(k) (linear only)
  /// P: rows of Omega applied per head to each of q and k (m frequencies, 2m nonstationary, 0 for elu)
  int64_t feature_projections = 0;
  /// C: tokens per chunk of the chunked form (1: the recurrent form); 0: one chunk per sample (the O(s^2)
  /// quadratic reference form). Linear only.
  int64_t chunk_size = 0;
  // Last, so that positional initialisers written before GQA keep their meaning.
  /// Key/value heads (grouped-query attention, Ainslie et al. 2023, arXiv 2305.13245); 0 = heads. The cost
  /// model's only: the dcp Transformer has no GQA, so this feeds `dcp simulate` / `dcp plan` (--kv-heads) and
  /// the planners' mode choice: d_kv = kv_heads x head_dim sets the K, V widths (their projections, the
  /// Ulysses and ring volumes), and a Ulysses degree must divide kv_heads (KV is not replicated; Megatron-Bridge
  /// HCP note, anchors-parallel-training.md section 2.3). Must divide heads.
  int64_t kv_heads = 0;

  /// Weight parameters of one layer: 2*h^2 (Q, O) + 2*h*d_kv (K, V; 4*h^2 in all without GQA) +
  /// mlp_matrices*h*ffn; biases and norms neglected.
  double params_per_layer() const;
  /// All parameters: layers * params_per_layer + vocab * hidden (tied input/output embedding).
  double params() const;
  /// hidden / heads, the per-head width D.
  double head_dim() const { return static_cast<double>(hidden) / static_cast<double>(heads); }
  /// kv_heads, or heads when it is 0: the head count that bounds a Ulysses degree.
  int64_t kv_head_count() const { return kv_heads > 0 ? kv_heads : heads; }
  /// d_kv = kv_head_count() * head_dim(), the width of K and of V per token, elements.
  double kv_dim() const { return static_cast<double>(kv_head_count()) * head_dim(); }
  /// Throws std::invalid_argument naming the first non-positive field (for linear attention: a non-positive
  /// feature_dim or a negative feature_projections or chunk_size; a negative kv_heads or one that does not
  /// divide heads).
  void validate() const;
};

/// The Ulysses exchanges of an aligned group of one SP size, fitted by `dcp profile` under `dcp launch` on the
/// real group. One all-to-all call that sends a rank's chunks takes latency_s + bytes_leaving_rank / bytes_per_s
/// seconds, where bytes_leaving_rank = (sp - 1) / sp of the bytes the rank holds (the chunk to itself stays);
/// both are fitted to the calls alone. Inside a real micro-batch every byte a rank exchanges costs
/// overhead_s_per_byte more, fitted to real SP micro-batches: what the calls alone do not show, the waits for a
/// peer that is behind, calls that run slower after compute, the copies around them (docs/sequence_parallel.md).
struct CommFit {
  double latency_s = 0;            ///< seconds per call
  double bytes_per_s = 0;          ///< bytes leaving a rank per second
  double overhead_s_per_byte = 0;  ///< seconds per byte a rank exchanges, in a micro-batch beyond the calls
};

/// A device and its interconnect.
struct DeviceSpec {
  std::string name = "h200";
  double memory_bytes = 141e9;        ///< HBM capacity, bytes
  double peak_flops = 989e12;         ///< published dense bf16 peak, FLOP/s (H100/H200 SXM datasheet)
  double mfu = 0.5;                   ///< achieved fraction of peak on the model's matmuls (linear layers)
  /// Achieved fraction of peak on the attention FLOPs (the s^2 terms); 0 = same as mfu. A profile sets it
  /// because attention kernels run at a different rate than the matmuls.
  double attention_mfu = 0;
  double intra_node_bw = 450e9;       ///< NVLink 4 per direction per GPU, bytes/s (18 links x 25 GB/s)
  double inter_node_bw = 50e9;        ///< InfiniBand NDR 400 Gb/s per GPU, bytes/s
  int64_t gpus_per_node = 8;
  double collective_latency_s = 10e-6;   ///< fixed latency of one all-to-all / all-reduce, seconds
  /// Rate of attention split into a ring's blocks relative to whole-sequence attention (ring and ulysses-ring
  /// groups). ring-flash-attention's zigzag ring reaches 90.2 % of FlashAttention's fwd+bwd on 8xH800
  /// (Llama-3.1-8B attention, 8K tokens per GPU, transfers on NVLink hidden; anchors-parallel-training.md
  /// section 1.4): what is left is the split kernels and the logsumexp merges, so the h200 model takes 0.9. A
  /// profile may set it ("ring_block_efficiency"; absent: 0.9, `dcp profile` does not measure ring attention).
  double ring_block_efficiency = 0.9;
  double micro_batch_overhead_s = 2e-3;  ///< kernel launches, data loading, loss: seconds per micro-batch
  /// Seconds each round of a step adds after the first (StepPlan rounds), beyond the wait for the slowest group
  /// that the sum of the rounds' makespans already holds: the ranks of a round's groups finish at slightly
  /// different times and the next round's groups wait for their members (no barrier). The h200 model takes one
  /// collective latency (10 us: the first collective of the next group absorbs the skew), an assumption;
  /// `dcp profile` under `dcp launch` measures it on the real groups ("round_switch").
  double round_switch_s = 10e-6;
  /// Measured all-to-alls by SP size (a profile's "sequence_parallel" fits). An SP size listed here uses its
  /// latency_s and bytes_per_s instead of collective_latency_s and intra_node_bw / inter_node_bw, and adds its
  /// overhead_s_per_byte.
  std::map<int64_t, CommFit> all_to_all;
  /// Measured ring exchanges by SP size (a profile's "sequence_parallel" "ring_fits"): one step of a ring over
  /// the aligned group of sp_size ranks, every rank sending a block to the next and receiving one from the
  /// previous, takes latency_s + block_bytes / bytes_per_s (overhead_s_per_byte is 0: not fitted). An SP size
  /// listed here uses them for its ring steps (ring and ulysses-ring groups of that size) instead of
  /// collective_latency_s and intra_node_bw / inter_node_bw.
  std::map<int64_t, CommFit> ring;

  /// attention_mfu, or mfu when attention_mfu is 0.
  double effective_attention_mfu() const { return attention_mfu > 0 ? attention_mfu : mfu; }

  /// The named device: "h200" (the defaults above), or the path of a JSON file written by `dcp profile`
  /// (read with from_profile). Throws std::invalid_argument naming `name`: as a missing file when it looks like a
  /// path (contains '/' or ends in .json), else with the known devices; from_profile's errors for a file.
  static DeviceSpec named(const std::string& name);

  /// Reads the "device" object of a JSON file written by `dcp profile` (write_profile in dcp/profiler.h): the
  /// string name and the numbers memory_bytes, peak_flops, mfu, attention_mfu, intra_node_bw, inter_node_bw, gpus_per_node,
  /// collective_latency_s and micro_batch_overhead_s, all required; the optional ring_block_efficiency and
  /// round_switch_s (absent in profiles written before rounds: the default); and
  /// all_to_all from the optional
  /// "sequence_parallel" object (absent in single-process profiles and in those written before SP was profiled):
  /// its array "fits" of objects with the integer sp_size (>= 2, each once) and the numbers latency_s (>= 0),
  /// bytes_per_s (> 0) and overhead_s_per_byte (>= 0); and ring from its optional array "ring_fits" (absent in
  /// profiles written before the ring was profiled) of objects with sp_size, latency_s and bytes_per_s, checked
  /// alike. Throws std::runtime_error naming the file when it cannot
  /// be read or is not JSON, std::invalid_argument naming the file and the field (e.g.
  /// 'sequence_parallel.fits[0].bytes_per_s') when a field is missing, has the wrong type or an impossible value.
  static DeviceSpec from_profile(const std::string& path);

  /// Checks that every rate lies in a physical range, so that the planners' times stay finite and positive
  /// (a hand-edited profile with peak_flops 1e-300 or an overhead of 1e300 s would otherwise make them 0 or inf):
  /// peak_flops x mfu (and x attention_mfu when set) in [1e3, 1e21] FLOP/s, mfu in (0, 10], attention_mfu in
  /// [0, 1e6], bandwidths (intra, inter and each all-to-all fit's) in [1e3, 1e15] B/s, gpus_per_node in
  /// [1, 1e6], ring_block_efficiency in (0, 1], latencies, micro_batch_overhead_s and round_switch_s in [0, 3600] s, overhead_s_per_byte in [0, 1] s, memory_bytes
  /// in (0, 1e18]; all-to-all and ring fits for sp_size >= 2. Throws std::invalid_argument naming the device, the field
  /// and the value.
  void validate() const;
};

/// FLOPs of a micro-batch, split by the rate they run at.
struct FlopCount {
  double linear = 0;     ///< matmuls of the linear layers and the vocabulary projection, FLOPs
  double attention = 0;  ///< the attention operator (s^2 terms for softmax, linear ones for linear), FLOPs
};

/// Predicted seconds of micro-batches and steps (Ulysses, ring and ulysses-ring sequence parallelism,
/// FlashAttention-style kernels).
///
/// A micro-batch holds packed samples of lengths s_1..s_n (tokens, T = sum s_j, no attention across samples),
/// runs on a group of `sp` ranks, and recomputes the activations of `r` of the L layers in backward. Its time is
///   seconds = fixed(sp, r) + sum_j work(s_j, sp, r)
/// where fixed(sp, r) = micro_batch_overhead_s + latency(sp) * (4 L + 2 r) when sp > 1 [the all-to-all calls,
/// see comm]
/// and work(s, sp, r) = compute(s, sp, r) + comm(s, sp, r):
///   compute = linear / (sp * peak_flops * mfu) + attention / (sp * peak_flops * attention_mfu)
///     linear = L 6 P_l s + r 2 P_l s + 6 h V s,  attention = L 6 h s^2 + r 2 h s^2  (FLOPs; attention_mfu 0
///     means mfu, see DeviceSpec), where
///     - 6 P_l s: matmul FLOPs forward (2 per parameter per token) plus backward (4) (Narayanan et al.,
///       arXiv 2104.04473, Eq. 3; Korthikanti et al., arXiv 2205.05198, App. A);
///     - 6 h s^2: causal attention; forward QK^T and AV cost 4 s^2 h without a mask, FlashAttention skips the
///       masked upper triangle so 2 s^2 h remain, backward is 2x forward (same sources; Megatron-LM
///       context_parallel.rst for the causal halving);
///     - a recomputed layer repeats its forward: 2 P_l s + 2 h s^2 (arXiv 2205.05198);
///     - 6 h V s: the output projection to the vocabulary, forward and backward, not recomputed.
///     Ulysses splits tokens (linear layers) and heads (attention) evenly over the sp ranks, hence the /sp.
///   With AttentionKind::kLinear the attention term is instead (3 L + r) * A(s) (backward 2x forward, a
///   recomputed layer repeats its forward, as above), where A(s), the forward FLOPs of all H heads, counts what
///   the chunked form of causal linear attention does per head (Katharopoulos et al., arXiv 2006.16236; chunks
///   as in Yang et al. GLA, arXiv 2312.06635, and fla; src/model/flexformer_scan.cpp), with F = feature_dim,
///   D' = head_dim + 1 (the denominator rides as an extra value column), C = chunk_size, P = feature_projections:
///     A(s) = H s (2 C F + 2 C D' + 4 F D' + 4 P D)
///     - 2 C F: the chunk's scores phi(Q) phi(K)^T, [C, F] x [F, C] per chunk (the full square: the kernel
///       computes it and masks after), 2 C D': the masked scores times V', [C, C] x [C, D'];
///     - 4 F D': the carried state read, phi(Q) S [C, F] x [F, D'], and updated, phi(K)^T V' [F, C] x [C, D'];
///     - 4 P D: the feature map's Omega x for q and k (2 P D each); elementwise cos/sin/elu are neglected.
///   The chunks run over the packed stream, so A is exactly linear in s whatever the sample boundaries. With
///   C = 0 (quadratic form) A(s) = H (2 s^2 (F + D') + 4 P D s). The Omega parameters (H P D per layer) are
///   not counted in params_per_layer (0.8 % of a layer of the 1.3B decoder at m = 64).
///   comm = (2 L + r) * 2 (h + d_kv) * (s / sp) * b * ((sp - 1) / sp / bw(sp) + overhead(sp))
///     - the calls SequenceParallelAttention makes (src/dist/sequence_parallel.cpp): per layer forward, one
///       all-to-all of q, k and v stacked (h + 2 d_kv elements per local token, d_kv = ModelShape::kv_dim(),
///       = h without GQA) and one of the output (h); backward runs the same two exchanges on their gradients
///       (the all-to-all is its own transpose); a recomputed layer repeats its forward's two. So 4 L + 2 r calls
///       per micro-batch, moving (2 L + r) 2 (h + d_kv) elements per local token ((8 L + 4 r) h without GQA;
///       spec section 2.3's 2 B c (2 h + 2 d_kv)). (DeepSpeed-Ulysses sends q, k and v in separate calls; the
///       12 L + 4 r calls of its count are not what this implementation runs.)
///     - of a rank's s/sp local tokens' bytes in a call, (sp - 1)/sp leave the rank (its own chunk stays);
///     - bw(sp), latency(sp), overhead(sp): the fitted CommFit of device.all_to_all for sp when present (`dcp
///       profile` under `dcp launch` measures them on the real group; overhead is its overhead_s_per_byte, the
///       cost of exchanging a byte inside a micro-batch beyond the calls), else bw = intra_node_bw when the
///       aligned group fits in a node (sp <= gpus_per_node), inter_node_bw otherwise, latency =
///       collective_latency_s and overhead 0.
///     comm is not overlapped with compute (conservative; the implementation does not overlap it either).
/// Ring modes (an SpLayout with R = ring_size() > 1 subgroups of u = ulysses_size ranks; u = 1 is the pure
/// ring, docs/sequence_parallel.md) change comm and fixed; compute keeps its FLOPs (zigzag balances the causal
/// work over the ranks, anchors-parallel-training.md section 1.4) with attention at ring_block_efficiency:
///   - the Ulysses part runs inside each subgroup: the comm above with u in place of sp in (u - 1) / u, bw(u),
///     latency(u) and overhead(u), still over the s / sp tokens a rank holds; none when u = 1.
///   - the ring: in each of R - 1 steps a rank sends its current K, V block to the next ring position while it
///     computes attention against the block it holds (Liu et al., arXiv 2310.01889; Megatron-LM
///     context_parallel.rst). A block is the keys and values of s / sp tokens for d_kv / u of the widths
///     (a subgroup's s / R tokens split over u ranks by heads), so block_bytes = 2 (s / sp) d_kv b whatever u.
///     Per step and layer forward, the block's attention takes t_c = A(s) / (sp R peak attention_mfu e) with
///     A(s) = 2 h s^2 the forward attention FLOPs above (zigzag: each of the R steps does 1/R of a rank's
///     work; e = ring_block_efficiency, which also divides the attention term of compute for these groups),
///     and its transfer t_x = block_bytes / bw_ring(sp). A step takes max(t_c, t_x): the transfer
///     hides behind the block's compute when that is long enough (the overlap condition of section 2.3), and
///     the last block's compute hides nothing. So a layer's forward exposes (R - 1) max(0, t_x - t_c); its
///     backward passes K, V and the dK, dV accumulators (twice the bytes) against twice the compute in each of
///     R - 1 steps, then one more dK, dV hop home that nothing hides: 2 (R - 1) max(0, t_x - t_c) + t_x; a
///     recomputed layer repeats its forward. Per sample:
///       ring_exposed = (3 L + r) (R - 1) max(0, t_x - t_c) + L t_x.
///     bw_ring(sp): the fitted device.ring[sp] when present (`dcp profile`: a timed ring exchange on the real
///     group), else intra_node_bw when the aligned group fits in a node, inter_node_bw otherwise (a ring over
///     more than gpus_per_node ranks has a hop across nodes, or all of them with u = gpus_per_node, and every
///     step waits for its slowest hop; each GPU has its own NIC).
///   - fixed adds latency_ring(sp) (device.ring[sp] or collective_latency_s) per ring step of the micro-batch,
///     ring_steps = (L + r) (R - 1) + L R, not hidden (conservative by at most that sum).
///   Samples are priced one by one, as for Ulysses: the runtime rings a micro-batch's packed stream, so one
///   sample's compute can hide another's transfer and the per-sample sum of exposed times is an upper bound on
///   that stream's (max(0, sum x - sum c) <= sum max(0, x - c)); it keeps time additive over samples, which
///   the planners need. Ring modes need softmax attention (kSoftmax, kSoftmaxReference).
/// A step adds step_seconds: the data-parallel gradient all-reduce of 2 (W-1)/W * params * b bytes per rank
/// (ring all-reduce) plus 2 collective latencies; the optimizer update is neglected. A step of R rounds takes
/// the sum over its rounds of the slowest group's seconds, plus (R - 1) * round_switch_s (round_seconds), plus
/// step_seconds (evaluate_step, dcp/planners.h).
class CostModel {
 public:
  /// Throws std::invalid_argument when the shape is invalid, a device rate is not positive, or an all_to_all
  /// fit has an sp_size below 2, a negative latency or overhead or a non-positive bandwidth.
  CostModel(ModelShape shape, DeviceSpec device);

  const ModelShape& shape() const { return shape_; }
  const DeviceSpec& device() const { return device_; }

  /// Seconds of one micro-batch with these sample lengths (tokens each) on sp ranks with r recomputed layers.
  /// Throws std::invalid_argument when lengths is empty, a length or sp is not positive, or r is outside [0, L].
  double seconds(const std::vector<int64_t>& lengths, int64_t sp_size, int64_t recompute_layers) const;
  /// The part of seconds() a sample of `length` tokens adds (compute + communication), seconds.
  double work_seconds(int64_t length, int64_t sp_size, int64_t recompute_layers) const;
  /// FLOPs of a micro-batch with these sample lengths and r recomputed layers, summed over the ranks of its
  /// group (the linear and attention sums of the class comment). Throws like seconds().
  FlopCount flops(const std::vector<int64_t>& lengths, int64_t recompute_layers) const;
  /// The part of seconds() that does not depend on the samples, seconds.
  double fixed_seconds(int64_t sp_size, int64_t recompute_layers) const;
  /// seconds, work_seconds and fixed_seconds of a group of `layout` (the overloads above are Ulysses,
  /// SpLayout{sp, sp}, and do not check the heads). Throw like them and when the layout is invalid (ulysses_size not dividing sp_size) or
  /// does not run on the shape (supports()).
  double seconds(const std::vector<int64_t>& lengths, const SpLayout& layout, int64_t recompute_layers) const;
  double work_seconds(int64_t length, const SpLayout& layout, int64_t recompute_layers) const;
  double fixed_seconds(const SpLayout& layout, int64_t recompute_layers) const;
  /// The table of work_seconds(lengths[i], layouts[k], recompute_layers[i * K + k]) into out[i * K + k]
  /// (K = layouts.size()) for every entry whose recompute_layers is >= 0 (the others are left alone): the same
  /// values bit for bit, each layout's rates and each sample's FLOPs computed once (dcp-opt's tables of every
  /// sample at every layout). Throws like work_seconds.
  void work_seconds(const std::vector<int64_t>& lengths, const std::vector<SpLayout>& layouts,
                    const int64_t* recompute_layers, double* out) const;
  /// Whether a group of `layout` runs on the shape: its Ulysses part (ulysses_size, when > 1) divides the KV
  /// heads (ModelShape::kv_head_count), and with a ring (ring_size() > 1) attention is softmax.
  bool supports(const SpLayout& layout) const;
  /// Bytes of one K, V block a rank sends per ring step for a micro-batch of `tokens` tokens: 2 (tokens / sp)
  /// d_kv b; 0 without a ring (ring_size() 1).
  double ring_block_bytes(int64_t tokens, const SpLayout& layout) const;
  /// Ring steps of one micro-batch with r recomputed layers: (L + r)(R - 1) + L R, 0 without a ring.
  int64_t ring_steps(const SpLayout& layout, int64_t recompute_layers) const;
  /// The seconds of ring transfer a sample of `length` tokens leaves exposed (not hidden behind its blocks'
  /// compute): (3 L + r)(R - 1) max(0, t_x - t_c) + L t_x (class comment); 0 without a ring.
  double ring_exposed_seconds(int64_t length, const SpLayout& layout, int64_t recompute_layers) const;
  /// Bytes per second of a ring step in an aligned group of sp ranks: the fitted device().ring[sp] when
  /// present, else NVLink inside a node, InfiniBand across.
  double ring_bandwidth(int64_t sp_size) const;
  /// Seconds per ring step in an aligned group of sp ranks: device().ring[sp] when present, else
  /// collective_latency_s.
  double ring_latency(int64_t sp_size) const;
  /// Per global step: gradient all-reduce over `world_size` ranks, seconds (0 for one rank).
  double step_seconds(int64_t world_size) const;
  /// Seconds a step of `rounds` rounds adds for its round switches: (rounds - 1) * device().round_switch_s (0
  /// for one round). Throws std::invalid_argument when rounds < 1.
  double round_seconds(int64_t rounds) const;
  /// Bytes leaving a rank per second in an all-to-all of an aligned group of sp ranks: the fitted
  /// device().all_to_all[sp] when present, else NVLink inside a node, InfiniBand across.
  double all_to_all_bandwidth(int64_t sp_size) const;
  /// Seconds per all-to-all call in an aligned group of sp ranks: the fitted device().all_to_all[sp] when
  /// present, else collective_latency_s.
  double all_to_all_latency(int64_t sp_size) const;
  /// All-to-all calls of one micro-batch on sp ranks with r recomputed layers: 4 L + 2 r when sp > 1, else 0.
  /// Throws std::invalid_argument when sp is not positive or r is outside [0, L].
  int64_t all_to_all_calls(int64_t sp_size, int64_t recompute_layers) const;
  /// Bytes a rank exchanges in the all-to-alls of one micro-batch of `tokens` tokens (sent, its own chunk
  /// included): (2 L + r) * 2 (hidden + d_kv) * (tokens / sp) * bytes_per_element when sp > 1, else 0. Throws
  /// like all_to_all_calls.
  double all_to_all_bytes(int64_t tokens, int64_t sp_size, int64_t recompute_layers) const;

 private:
  void check(int64_t sp_size, int64_t recompute_layers) const;
  void check(const SpLayout& layout, int64_t recompute_layers) const;
  // The same with the all-to-alls inside subgroups of layout.ulysses_size.
  double all_to_all_bytes(int64_t tokens, const SpLayout& layout, int64_t recompute_layers) const;
  // Unchecked cores of ring_exposed_seconds, work_seconds and fixed_seconds (sp and r checked by the caller).
  double ring_exposed(int64_t length, const SpLayout& layout, int64_t recompute_layers) const;
  double work(int64_t length, const SpLayout& layout, int64_t recompute_layers) const;
  // The factors of work() and ring_exposed() that depend on the layout alone.
  struct LayoutTerms {
    double attention_rate = 0;   // attention FLOP/s per peak FLOP/s (the ring's block efficiency included)
    double sp_peak = 0;          // sp_size * peak FLOP/s
    double a2a_per_byte = 0;     // seconds per all-to-all byte: leaving fraction / bandwidth + overhead
    double ring_rate = 0;        // sp_size * R * peak * attention MFU * ring block efficiency (R > 1)
    double ring_bandwidth = 0;   // ring_bandwidth(sp_size)
  };
  LayoutTerms layout_terms(const SpLayout& layout) const;
  // work() and ring_exposed() from the sample's FLOPs at that recompute count (sample_flops), its attention
  // forward FLOPs (attention_forward_flops) and the layout's terms.
  double work(int64_t length, const SpLayout& layout, int64_t recompute_layers, const FlopCount& flops,
              double attention_forward, const LayoutTerms& terms) const;
  double ring_exposed(int64_t length, const SpLayout& layout, int64_t recompute_layers, double attention_forward,
                      const LayoutTerms& terms) const;
  double fixed(const SpLayout& layout, int64_t recompute_layers) const;

  ModelShape shape_;
  DeviceSpec device_;
};

/// Per-rank bytes of a micro-batch, in the one form both memory models share:
///   bytes = base + t * (a (L - r) + b r + c + [sp > 1] e) + Q * (q (L - r) + q0)
/// with t = tokens / sp (tokens a rank holds), Q = sum_j s_j^2 / sp over the micro-batch's sample lengths s_j
/// (a rank's attention scores: Ulysses gives it the s tokens of h/sp heads of every sample), L layers of which
/// r recompute their activations in backward.
struct MemoryCoefficients {
  double base_bytes = 0;          ///< bytes independent of the micro-batch (weights, gradients, optimizer state)
  double token_layer_bytes = 0;   ///< a: per local token per layer that keeps its activations, bytes
  double token_recompute_bytes = 0;  ///< b: per local token per recomputed layer (it keeps its input), bytes
  double token_bytes = 0;         ///< c: per local token once (the layer being back-propagated, logits), bytes
  double square_layer_bytes = 0;  ///< q: per local squared token per layer that keeps its activations, bytes
  double square_bytes = 0;        ///< q0: per local squared token once (the working layer's scores), bytes
  /// e: per local token once when sp > 1 (Ulysses' all-to-all buffers beyond what sp 1 holds), bytes
  double sp_token_bytes = 0;
};

/// Predicted peak bytes on one rank of a group running one micro-batch, and the per-rank budget they must fit.
///
/// Two sources of coefficients (MemoryCoefficients gives the formula):
/// - analytic (the constructor and analytic(); the h200 model; q = q0 = 0, FlashAttention keeps no s^2 scores
///   and neither does chunked linear attention;
///   e = 0, the workspace covers communication buffers):
///   base = 16 * params + workspace, a = full, b = input, c = full + logits, where
///   - 16 * params: mixed-precision Adam, unsharded (every rank holds bf16 weights 2 B, bf16 gradients 2 B,
///     fp32 master weights, m and v 12 B per parameter; Rajbhandari et al. ZeRO, arXiv 1910.02054, Sec. 3.1).
///     Unsharded is the conservative choice: the trainer replicates states over data-parallel ranks. (For this
///     CPU build's fp32, weights 4 + gradients 4 + AdamW m and v 8 B also make 16 B per parameter.)
///   - full = (10 h + 6 ffn) * (b / 2) per token: activations a layer keeps for backward without recompute.
///     Korthikanti et al. (arXiv 2205.05198, Table 2) give 34 s b h bytes in 16-bit with FlashAttention or
///     selective recompute (no s^2 score matrix), of which 10 s b h is attention and 24 s b h the 4h-wide MLP;
///     the MLP share is scaled here to the actual width (24 h = 6 * 4h). Ulysses divides by sp (each rank
///     holds s/sp tokens outside attention and s tokens of h/sp heads inside).
///   - input = h * b per token: a recomputed layer keeps only its input (same source, full recompute 2 s b h).
///   - the c term's `full`: the working set of the layer being recomputed or back-propagated.
///   - logits = vocab * (b + 4) per token: 16-bit logits plus their fp32 softmax for the loss (no chunking).
///   - workspace: a fixed reserve for kernels, communication buffers and fragmentation.
///   - linear attention (AttentionKind::kLinear) keeps the same q, k, v, input and output, plus fp32 tensors
///     (the operator computes in fp32 whatever the activations' dtype) per token and layer, added to `full`:
///     4 H (2 F + D' + C + F D' / C + 2 P) bytes: phi(q), phi(k); V' = [v, 1]; the chunk's masked scores
///     (C per token); the state carried into each chunk (F D' per C tokens, autograd keeps it for phi(Q) S);
///     Omega x of q and k (the input of cos/sin). An estimate from the autograd graph of
///     src/model/flexformer_scan.cpp; on the default CPU model (d 128, 4 heads, m 64, C 64) it gives 8.8 KB per
///     token and layer where `dcp profile` measured 7.9 KB more than for the softmax model
///     (bench/results/h200-sim_202612_flexformer.md). With C = 0 the scores are s per token: q = 4 H (per local
///     squared token per layer), q0 = q, and the state term is dropped.
/// - fitted (from_profile(): `dcp profile` measures peak bytes of tensor storage on a grid of micro-batches at
///   sp 1 and fits base, a, b, q, q0 >= 0; c is 0 because c t = (c / L)(t (L - r) + t r) is not separable
///   from a and b). The CPU's softmax attention keeps [heads, s, s] probabilities and masks per sample, hence Q;
///   a chunked linear-attention model keeps none, and its fit finds q, q0 near 0 by itself (1.9 and 1.3 B on the
///   default CPU model, against 12.7 and 17 B for softmax).
///   The sp scaling is assumed by the sp-1 grid; e, the stacked q, k, v and their contiguous send copy that
///   SequenceParallelAttention allocates and sp 1 does not, is 6 h b for a one-process profile (a 2-rank run of
///   the fp32 default model measured up to 2.5 KB per local token above the sp-1 fit; 6 h b = 3 KB there) and,
///   under `dcp launch`, the largest excess per local token of the measured SP micro-batches over the sp-1 fit
///   (1.76 KB on the main job's bf16 model, set by its smallest SP micro-batches; 6 h b = 1.5 KB there).
///
/// The planners know a micro-batch's tokens only, not its lengths: bytes(tokens, ...) bounds Q by
/// tokens * min(tokens, longest_sample_tokens) / sp (sum s_j^2 <= max s_j * sum s_j), so it never predicts less
/// than bytes(lengths, ...) of any micro-batch of that many tokens. The bound matters only when q or q0 > 0.
class MemoryModel {
 public:
  /// The analytic model with budget memory_fraction * device.memory_bytes. Throws std::invalid_argument when
  /// the shape is invalid, memory_fraction is outside (0, 1], memory_bytes is not positive or workspace_bytes
  /// is negative.
  MemoryModel(ModelShape shape, DeviceSpec device, double memory_fraction = 0.9, double workspace_bytes = 4e9);

  /// The analytic model with an explicit per-rank budget (bytes). Throws std::invalid_argument when the shape
  /// is invalid, budget_bytes is not positive and finite or workspace_bytes is negative.
  static MemoryModel analytic(ModelShape shape, double budget_bytes, double workspace_bytes = 4e9);
  /// A model with the given coefficients (bytes each, all >= 0), budget (bytes) and longest sample (tokens; 0 =
  /// no bound, Q <= tokens^2). Throws std::invalid_argument naming a negative or non-finite coefficient, a bad
  /// budget, a negative longest_sample_tokens or an invalid shape.
  MemoryModel(ModelShape shape, MemoryCoefficients coefficients, double budget_bytes,
              int64_t longest_sample_tokens = 0);
  /// Reads the fitted model of a JSON file written by `dcp profile` (write_profile in dcp/profiler.h): the
  /// "model" object (the shape that was measured; shape() returns it) and the "memory" object's base_bytes,
  /// token_layer_bytes, token_recompute_bytes, token_bytes, square_layer_bytes, square_bytes and
  /// sp_token_bytes (when absent: 6 * hidden * bytes_per_element, the value `dcp profile` writes). The "model"
/// object's attention ("softmax" or "linear"; absent: softmax, profiles written before it was recorded),
/// feature_dim, feature_projections and chunk_size (required for linear) give the shape's attention; its
/// optional "precision" must name the precision of its bytes_per_element (precision_of_bytes). Throws
  /// std::runtime_error naming the file when it cannot be read or is not JSON, std::invalid_argument naming the
  /// file and the field when one is missing or not a number (a profile written before memory was fitted has no
  /// "memory" object: rerun `dcp profile`), and what the coefficient constructor throws.
  static MemoryModel from_profile(const std::string& path, double budget_bytes, int64_t longest_sample_tokens = 0);

  /// Peak bytes on a rank for a micro-batch of `tokens` tokens on sp ranks with r recomputed layers (the
  /// longest_sample_tokens bound on Q). Throws std::invalid_argument when tokens or sp is not positive or r is
  /// outside [0, L].
  double bytes(int64_t tokens, int64_t sp_size, int64_t recompute_layers) const;
  /// Peak bytes on a rank for a micro-batch of these sample lengths (tokens each; Q exact). Throws like
  /// bytes(tokens, ...) and when lengths is empty or a length is not positive.
  double bytes(const std::vector<int64_t>& lengths, int64_t sp_size, int64_t recompute_layers) const;
  /// Per-rank memory budget, bytes.
  double budget_bytes() const { return budget_; }
  /// The fewest recomputed layers with which `tokens` fit the budget on sp ranks, or nullopt when even full
  /// recompute does not fit. Memory falls linearly in r and time rises with r, so the cheapest feasible choice
  /// is this closed form; with identical layers no knapsack is needed (the reference's PAC knapsack is over
  /// heterogeneous block types, dcp-reference.md section 2.4).
  std::optional<int64_t> min_recompute_layers(int64_t tokens, int64_t sp_size) const;
  /// The most tokens one micro-batch on sp ranks may hold with r recomputed layers (0 when none fit).
  int64_t max_tokens(int64_t sp_size, int64_t recompute_layers) const;

  const ModelShape& shape() const { return shape_; }
  const MemoryCoefficients& coefficients() const { return c_; }
  /// The bound on a sample's length used by bytes(tokens, ...), tokens (0 = none).
  int64_t longest_sample_tokens() const { return longest_; }
  /// "analytic" or "profile".
  const std::string& source() const { return source_; }

 private:
  double bytes_of(double local_tokens, double local_squares, int64_t sp_size, int64_t recompute_layers) const;
  void check(int64_t tokens, int64_t sp_size, int64_t recompute_layers) const;

  ModelShape shape_;
  MemoryCoefficients c_;
  double budget_ = 0;
  int64_t longest_ = 0;
  std::string source_ = "analytic";
};

}  // namespace dcp
