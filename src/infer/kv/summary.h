// Weighted summaries of a block of cached entries for the `minimax` KV-cache policy (dcp/kv_policies.h): which
// entries of the block stay, with which log-weight biases (and optionally refitted values), so that attention
// over the summary reproduces attention over the block for a set of reference queries; and an estimate of how
// compressible the block is.
//
// Reconstruction of "The risk of KV cache compression" (Haverbeck et al., arXiv 2607.01520), known only from its
// abstract and a secondhand section map: ../shared/specs/kv-cache-compression.md section 2 (model) and 4.3
// (COMPRESS). What each piece comes from is said at the piece; docs/kv_cache.md "minimax" says what is ours.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "dcp/kv_cache.h"

namespace dcp {

/// The position of a reference query that comes after every entry (a sampled or probe query: a future one).
constexpr int64_t kKvFutureQuery = std::numeric_limits<int64_t>::max();

/// The head's attention probabilities softmax(scale q.K^T + bias) over its entries, in `dtype` (kDouble or
/// kFloat). queries [Q, head_dim] floating (after rotary, unscaled). `query_positions` [Q] int64, when defined,
/// is the position each query ran at: entries at later positions are masked out (a query saw only what came
/// before it; kKvFutureQuery sees everything); undefined = no mask (queries after every entry). A query that sees
/// no entry gets a row of zeros. Returns [Q, view.length()]. Shapes are the caller's to check.
torch::Tensor kv_head_probs(const KvHeadView& view, const torch::Tensor& queries, double scale,
                            const torch::Tensor& query_positions = {}, torch::ScalarType dtype = torch::kDouble);

/// How a KvBlockSummary grows its greedy path (a pivoted Cholesky of the block's Gram G). Every method takes the
/// same entries up to rounding (near-ties may swap) with the same error curve to rounding; the tests compare them
/// (test_kv_minimax.cpp, KvSummary.BlockedPathMatchesItsPlainTwin).
enum class KvSummaryMethod {
  /// Left-looking while the path is short, blocked right-looking once its columns would hold 4 MiB (2^19 fp64
  /// values: beyond the caches, where the left-looking step's matrix-vector product is memory-bound) and n / 8
  /// steps are taken. The default.
  kAuto,
  /// Blocked right-looking from max(32, n / 8) steps on, whatever the size (the tests force it on small blocks).
  /// The Schur complement R = G - L L^T over the entries not yet taken is kept as a matrix (fp64); each step's
  /// column is the pivot's row of R less the current block's pending columns at the pivot, and every 32 steps
  /// one rank-32 update (a BLAS-3 matrix product) folds the block into R, as LAPACK's blocked pivoted Cholesky
  /// (dpstrf; C. Lucas, "LAPACK-style codes for level 2 and 3 pivoted Cholesky factorizations", LAPACK Working
  /// Note 161, 2004) with the greedy's own pivot rule. R drops the taken entries once they are 1/16 of it.
  /// Per step ~2 n^2 flops at matrix-product speed, where left-looking reads every column so far (k n).
  kBlocked,
  /// The reference twin: left-looking, each step's column G[:, j] - sum_s L_s L_s[j] over the columns taken so
  /// far, an in-order loop on the calling thread (no BLAS: the same bits on any thread count).
  kPlain,
};

/// One head's summary problem for a block of its entries. With reference queries q_1..q_Q (rows of `queries`)
/// and p_q = softmax(scale q.K^T + bias) over the entries of the head that q sees (causal by position, so masses
/// are relative to the head's total, spec section 2: errors count relative to D(q)), o_q = p_q V, a summary
/// gives block entry i a weight w_i >= 0 (0 = evicted; stored as bias += log w_i). To first order its output
/// error for q is
///   sum_{i in block} (w_i - 1) p_qi (v_i - o_q)          (the error identity o~ - o = (dN - o dD) / D~)
/// and its mass error sum_i (w_i - 1) p_qi. Both are linear in w: a column a_i per entry stacks
/// p_qi (v_i - o_q) over q and gamma p_qi over q (gamma^2 = the mass-weighted mean of ||v_i - o_q||^2, so mass
/// rows weigh like output rows), and the summary solves min ||A (w - 1)||^2 over sparse w >= 0, through the Gram
/// G = A^T A / Q formed from [Q, n] products (never A itself). In fp32 (`dtype` kFloat, the default: the fast
/// path) with b_qi = p_qi (s_q / 2 - o_q.v_i), s_q = ||o_q||^2 + gamma^2, G = (P^T P o V V^T + B^T P + P^T B) / Q:
/// one [2n, Q] x [Q, n] matmul ([P | B]^T P) and V V^T, then one pass that symmetrises, scales and widens to
/// fp64 and sums the rows. In fp64 (kDouble) the reference twin the tests compare it with: the plain expansion,
/// three [n, Q] x [Q, n] matmuls and elementwise tensor ops. The greedy path (KvSummaryMethod) and the weight fit
/// then run in fp64 on G.
class KvBlockSummary {
 public:
  /// view: the head; queries [Q, head_dim] (after rotary, unscaled, any floating dtype, Q >= 1); scale > 0 the
  /// softmax scale; block [n] int64 distinct indices into the view (n >= 1); query_positions as kv_head_probs
  /// (undefined: every query sees every entry); dtype kFloat or kDouble; method: KvSummaryMethod. Throws
  /// std::invalid_argument for shapes that do not fit, an index out of range or another dtype.
  KvBlockSummary(const KvHeadView& view, const torch::Tensor& queries, double scale, const torch::Tensor& block,
                 const torch::Tensor& query_positions = {}, torch::ScalarType dtype = torch::kFloat,
                 KvSummaryMethod method = KvSummaryMethod::kAuto);
  /// The same summary from the head's attention probabilities already computed by the caller: probs
  /// [Q >= 1, view.length()] = kv_head_probs(view, queries, scale, query_positions, dtype) (minimax computes them
  /// once for its compressibility estimate and the summary). Throws std::invalid_argument as above, and for
  /// probs of another shape or dtype.
  KvBlockSummary(const KvHeadView& view, const torch::Tensor& probs, const torch::Tensor& block,
                 torch::ScalarType dtype = torch::kFloat, KvSummaryMethod method = KvSummaryMethod::kAuto);

  int64_t block_size() const { return n_; }

  /// Greedy selection (orthogonal matching pursuit on A with least-squares weights, computed as a pivoted
  /// Cholesky of G: each step takes the entry whose addition lowers the residual most, among entries positively
  /// correlated with it, as spec 4.3 step 3 "greedy pivoted Cholesky / OMP on columns of [Phi V; Phi]").
  /// Extends the path to min(atoms, block_size()) entries (a longer request continues where the last stopped);
  /// stops early when no entry lowers the residual. Cost: KvSummaryMethod.
  void extend(int64_t atoms);
  /// Block positions (indices into `block`) in the order the greedy path took them.
  const std::vector<int64_t>& order() const { return order_; }
  /// error()[k]: mean squared first-order error over the reference queries with the first k entries of the
  /// path at their least-squares weights (k = 0..order().size()); error()[0] is evicting the whole block.
  const std::vector<double>& error() const { return error_; }
  /// The mean over the reference queries of ||o_q||^2, the head's output energy: error()[k] / output_energy()
  /// is the squared relative error of the block's summary (0 when every output is 0).
  double output_energy() const { return output_energy_; }
  /// sqrt(error()[k] / output_energy()) (0 when the energy is 0): the predicted relative output error.
  double relative_error(int64_t k) const;
  /// Whether the path cannot grow: every entry taken or no entry lowers the residual any more.
  bool exhausted() const { return exhausted_; }

  struct Fit {
    torch::Tensor atoms;       ///< [m] int64 indices into `block`, ascending; weights > 0
    torch::Tensor log_weight;  ///< [m] fp32: added to those entries' biases
    torch::Tensor values;      ///< [m, value_dim] fp32 refitted values; undefined unless refit_values
    double error = 0;          ///< mean squared first-order error of these weights (as error())
  };
  /// Non-negative least squares for the weights of the first `atoms` entries of the path (spec 4.3 step 4,
  /// Attention Matching's NNLS mass fit, here on outputs and mass together), by kv_nnls (an exact active-set
  /// solver); entries whose weight is 0 are left out. refit_values: then least squares
  /// for their values so that the weighted numerator matches the block's on the reference queries (spec 4.3
  /// step 4, optional; ridge towards the original values). Throws std::invalid_argument for atoms outside
  /// [1, order().size()].
  Fit fit(int64_t atoms, bool refit_values) const;

 private:
  void init(const KvHeadView& view, const torch::Tensor& probs, const torch::Tensor& block, torch::ScalarType dtype);
  // gram_ from U = O V^T [Q, n] and s_q = ||o_q||^2 + gamma^2 [Q]: the fp32 fused products or the fp64 expansion.
  void form_gram(const torch::Tensor& u, const torch::Tensor& s, torch::ScalarType dtype);
  void reserve_columns(int64_t rows, int64_t keep, int64_t hint);  // chol_ >= rows rows, its first `keep` kept
  void start_blocked();                   // R = G - L L^T over the entries not yet taken
  void flush_block();                     // R -= the pending block's columns; drops taken entries from R

  int64_t n_ = 0;
  KvSummaryMethod method_ = KvSummaryMethod::kAuto;
  std::vector<double> gram_;  // [n, n] row-major, fp64
  std::vector<double> c_;     // G 1
  double total_ = 0;          // 1^T G 1
  double output_energy_ = 0;
  double max_diag_ = 0;       // max_i G_ii
  torch::Tensor probs_, block_values_;  // [Q, n], [n, value_dim] in the summary dtype (for the value refit)
  // Greedy state (plain arrays: a step is O(n x steps) flops, far below a library call's overhead).
  std::vector<int64_t> order_;
  std::vector<double> error_;
  torch::Tensor chol_;              // [capacity, n] fp64: row s = the Cholesky column of the s-th chosen entry
  std::vector<double> residual_, remaining_;  // [n]: correlation with the residual, column norm left
  std::vector<char> available_;     // [n]: not chosen yet
  bool exhausted_ = false;
  // Blocked (right-looking) state: the Schur complement over `active_` entries, the block's pending columns.
  bool blocked_ = false;
  std::vector<int64_t> active_;     // block positions R covers
  std::vector<int64_t> active_at_;  // [n]: an entry's position in active_, -1 if none
  torch::Tensor schur_;             // [na, na] fp64
  torch::Tensor pending_;           // [kBlock, na] fp64: the current block's scaled columns over active_
  int64_t pending_count_ = 0;
  std::vector<double> factor_;      // the path's Cholesky factor L (G over the path in path order), packed rows
};

/// What KvBlockSummary's first-order error model reads of a block, from the head's attention probabilities
/// probs [Q, view.length()] (fp32 or fp64; kv_head_probs) over `block` [n] int64 indices into the view, in
/// probs' dtype: o_q = p_q V over the whole head, the block's probabilities [Q, n] and values [n, value_dim],
/// u_qi = o_q.v_i [Q, n], ||o_q||^2 [Q], the squared distances ||v_i - o_q||^2 [Q, n] (clamped at 0) and gamma^2,
/// their mass-weighted mean over the block (1 when the block has no mass): the weight of a mass row. Shared by
/// the summary's Gram and minimax's screening (which ranks entries by G_ii = mean_q p_qi^2 (dist2_qi + gamma^2)).
/// No checks: callers validate shapes and indices.
struct KvBlockResponse {
  torch::Tensor probs, values, u, o2, dist2;
  double gamma2 = 1;
  KvBlockResponse(const KvHeadView& view, const torch::Tensor& probs, const torch::Tensor& block);
};

/// Non-negative least squares in normal-equation form: argmin over w >= 0 of w^T G w - 2 c^T w, for G [m, m]
/// (row-major, symmetric positive semi-definite, fp64) and c [m]: the active-set method of Lawson and Hanson
/// (Solving Least Squares Problems, 1974, ch. 23) on the normal equations as in Bro and De Jong's "fast NNLS"
/// (J. Chemometrics 1997), warm-started from the clipped least-squares solution (most weights of a summary are
/// positive, so few active-set changes follow). The passive set's Cholesky factor (with the ridge 1e-12 x max
/// diag(G), the same as kv_nnls_reference's start) is factorised once and then updated as indices join (one
/// forward substitution) or leave (a rank-1 update of the trailing factor), O(k^2) per change instead of a fresh
/// O(k^3) factorisation (Golub and Van Loan, Matrix Computations, 6.5.4); where an update fails (a numerically
/// dependent index) or an eighth of the set leaves at once, it is factorised afresh. `factor`, when given, is the
/// Cholesky factor L of G itself (lower triangular, packed by rows: row i holds L[i][0..i], m (m + 1) / 2
/// values; KvBlockSummary's greedy path has it): the start then costs no factorisation. Stops when no zero
/// weight has a descent direction (c - G w)_a > 1e-12 x max |c|, or after 4m + 16 set changes (the weights are
/// then feasible, not certified). m = 0 gives {}. Throws std::invalid_argument when g has not m x m elements, the
/// factor not m (m + 1) / 2, G or c holds a value that is not finite, or G is not positive semi-definite (its
/// Cholesky fails with a ridge of 1e-3 x max diag G: not a Gram matrix). The given factor is of G without the ridge; indices appended later get it
/// (a 1e-12-relative difference).
std::vector<double> kv_nnls(const std::vector<double>& g, const std::vector<double>& c,
                            const std::vector<double>& factor = {});

/// The reference twin of kv_nnls: cyclic coordinate descent (each coordinate's exact minimiser in turn, the
/// gradient kept up to date) from the clipped least-squares solution, until no weight moves by more than `tol`
/// in a sweep or after `sweeps` sweeps. Before issue 27's speed work this was the fit (500 sweeps, tol 1e-10),
/// which stopped at the sweep limit on most summaries of a trained model. Same inputs as kv_nnls, and its shape and
/// finiteness errors.
std::vector<double> kv_nnls_reference(const std::vector<double>& g, const std::vector<double>& c, int sweeps,
                                      double tol);

/// The compressibility estimate of spec section 2: the eigenvalue tail of the mass-normalised response Gram
/// G_ij = sum_q p_qi p_qj (v_i.v_j + 1) of a sample of entries, normalised by its trace: the share of the
/// sample's response energy beyond its `keep` largest eigen-directions. ~0 for a block whose responses live in a
/// few directions (clustered keys), ~1 - keep/S for near-orthogonal keys probed by lookup-like queries (a flat
/// spectrum: every entry answers a query of its own). probs [Q, S] (rows: reference queries, columns: the
/// sampled entries' attention probabilities over the whole head), values [S, value_dim]; keep in [0, S].
/// Returns a value in [0, 1] (0 when the responses are all zero). Throws std::invalid_argument for shapes
/// that do not fit.
double kv_spectral_tail(const torch::Tensor& probs, const torch::Tensor& values, int64_t keep);

/// Risk of a fitted summary on queries it was not fitted to (spec 4.3's fit cross-validated: future queries are
/// not the reference ones): with block weights w (exp(log_weight) for `atoms`, 0 for the rest of `block`) the
/// first-order output error e_q = sum_{i in block} (w_i - 1) p_qi (v_i - o_q) (KvBlockSummary's), relative to
/// the head's output: sqrt(sum_q ||e_q||^2 / sum_q ||o_q||^2) over `queries` (0 when every output is 0).
/// Evicting the block exactly gives (o~_q - o_q) D~_q / D_q, the true change scaled by the mass kept. view,
/// scale, block, query_positions as KvBlockSummary; queries [Q >= 1, head_dim]; atoms [m] int64 indices into
/// `block`, log_weight [m]. Throws std::invalid_argument for shapes that do not fit or an index out of range.
double kv_heldout_rel_error(const KvHeadView& view, const torch::Tensor& queries, double scale,
                            const torch::Tensor& block, const torch::Tensor& atoms, const torch::Tensor& log_weight,
                            const torch::Tensor& query_positions = {});

}  // namespace dcp
