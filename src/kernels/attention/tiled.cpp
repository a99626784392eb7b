// The tiled exact attention operator: FlashAttention-2 (Dao 2023) forward and backward loops over tiles of one
// (sample, head), scheduled over threads, and its autograd Function. The tile products and softmax steps are in
// tiles*.cpp, the operand layouts in tile_policies.h.
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/autograd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "dcp/attention_kernels.h"
#include "dcp/cpu_features.h"
#include "kernels/attention/arena.h"
#include "kernels/attention/tile_policies.h"
#include "kernels/attention/varlen.h"

namespace dcp {
namespace {

using tiles::Arena;
using tiles::parallel_with_arenas;
using tiles::round_up;

constexpr double kLog2e = 1.4426950408889634;
constexpr double kLn2 = 0.6931471805599453;

// One (sample, head) and the shapes of its tiles. Sizes are in tokens; tile counts cover the sample.
struct Geometry {
  int64_t lq = 0, lk = 0;      // queries and keys of the sample
  int64_t offset = 0;          // Lk - Lq: query r sits at key position r + offset (bottom-right alignment)
  bool causal = false;
  int64_t bq = 0, bk = 0;      // tile sizes (multiples of the policy's alignment)

  int64_t q_tiles() const { return (lq + bq - 1) / bq; }
  int64_t k_tiles() const { return (lk + bk - 1) / bk; }
  // Keys [0, key_end(r)) are attended by query r.
  int64_t key_end(int64_t r) const { return causal ? std::clamp<int64_t>(r + offset + 1, 0, lk) : lk; }
  // The first query that attends key c.
  int64_t first_query(int64_t c) const { return causal ? std::clamp<int64_t>(c - offset, 0, lq) : 0; }
  int64_t key_tiles_of_q_tile(int64_t i) const {
    return (key_end(std::min(lq, (i + 1) * bq) - 1) + bk - 1) / bk;
  }
  int64_t first_q_tile_of_k_tile(int64_t j) const { return first_query(j * bk) / bq; }
};

// A range of tiles of one (sample, head): query tiles in forward, key tiles in backward.
struct Unit {
  int64_t sample = 0, head = 0, begin = 0, end = 0, work = 0;
  int64_t piece = 0;   // index of this range among its (sample, head)'s, in tile order
  int64_t split = -1;  // backward: index of the SplitDq of its (sample, head) when that one is split
};

// Cuts every (sample, head) into units and orders them longest first, so that threads taking the next unit
// finish together (LPT). A (sample, head) whose work exceeds half of one thread's share is split into ranges of
// about that share (FlashAttention-2's parallelisation over the sequence), so one long sample keeps every
// thread busy; `tile_work(s, t)` is the work of tile t of sample s, in tile products.
template <class TileWork>
std::vector<Unit> schedule(const std::vector<int64_t>& tile_counts, int64_t heads, int64_t threads,
                           TileWork tile_work) {
  int64_t total = 0;
  std::vector<std::vector<int64_t>> works(tile_counts.size());
  for (size_t s = 0; s < tile_counts.size(); ++s) {
    for (int64_t t = 0; t < tile_counts[s]; ++t) works[s].push_back(std::max<int64_t>(1, tile_work(s, t)));
    total += heads * std::accumulate(works[s].begin(), works[s].end(), int64_t{0});
  }
  const int64_t target = threads > 1 ? std::max<int64_t>(1, total / (2 * threads)) : total + 1;
  std::vector<Unit> units;
  for (size_t s = 0; s < works.size(); ++s) {
    if (works[s].empty()) continue;
    for (int64_t h = 0; h < heads; ++h) {
      Unit u{static_cast<int64_t>(s), h, 0, 0, 0};
      for (int64_t t = 0; t < static_cast<int64_t>(works[s].size()); ++t) {
        if (u.work >= target) {
          units.push_back(u);
          u = Unit{u.sample, h, t, t, 0, u.piece + 1};
        }
        u.end = t + 1;
        u.work += works[s][t];
      }
      units.push_back(u);
    }
  }
  std::stable_sort(units.begin(), units.end(), [](const Unit& a, const Unit& b) { return a.work > b.work; });
  return units;
}

template <class P>
struct Operands {
  using In = typename P::In;
  const In* q;
  const In* k;
  const In* v;
  int64_t sq0, sq1, sk0, sk1, sv0, sv1;  // token and head strides
  int64_t heads, head_dim;
};

template <class P>
Operands<P> operands_of(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  using In = typename P::In;
  return {q.data_ptr<In>(), k.data_ptr<In>(), v.data_ptr<In>(), q.stride(0), q.stride(1), k.stride(0),
          k.stride(1),      v.stride(0),      v.stride(1),      q.size(1),   q.size(2)};
}

Geometry geometry_of(const VarlenBounds& b, int64_t s, bool causal, int64_t bq, int64_t bk) {
  Geometry g;
  g.lq = b.q_len(s);
  g.lk = b.k_len(s);
  g.offset = g.lk - g.lq;
  g.causal = causal;
  g.bq = bq;
  g.bk = bk;
  return g;
}

// ---- the passes' shared preamble: tile geometry and units ---------------------------------------------------

// How a pass walks a (sample, head): the forward by query tiles (each costs the key tiles it attends), the
// backward by key tiles (each costs the query tiles that attend it).
enum class Walk { kQueryTiles, kKeyTiles };

// A pass's units over the threads, and the largest extents of a sample its per-thread arenas must hold.
struct PassPlan {
  std::vector<Unit> units;
  int64_t most_key_tiles = 0;  // the most key tiles of a sample
  int64_t most_rows = 0;       // the most query rows of a sample, rounded up to whole query tiles
};

PassPlan plan_pass(const VarlenBounds& b, bool causal, int64_t bq, int64_t bk, int64_t heads, int64_t threads,
                   Walk walk) {
  PassPlan plan;
  std::vector<int64_t> tiles;
  for (int64_t s = 0; s < b.samples(); ++s) {
    const Geometry g = geometry_of(b, s, causal, bq, bk);
    if (walk == Walk::kQueryTiles) {
      tiles.push_back(g.lk > 0 ? g.q_tiles() : 0);
    } else {
      tiles.push_back(g.lq > 0 ? g.k_tiles() : 0);
    }
    plan.most_key_tiles = std::max(plan.most_key_tiles, g.k_tiles());
    plan.most_rows = std::max(plan.most_rows, round_up(g.lq, bq));
  }
  plan.units = schedule(tiles, heads, threads, [&](size_t s, int64_t t) {
    const Geometry g = geometry_of(b, static_cast<int64_t>(s), causal, bq, bk);
    return walk == Walk::kQueryTiles ? g.key_tiles_of_q_tile(t) : g.q_tiles() - g.first_q_tile_of_k_tile(t);
  });
  return plan;
}

// ---- forward (FlashAttention-2 Algorithm 1) ------------------------------------------------------------------

template <class P>
void forward_pass(const P& pol, const Operands<P>& x, const VarlenBounds& b, bool causal, double scale,
                  int64_t bq, int64_t bk, typename P::In* out, typename P::Acc* lse) {
  using Acc = typename P::Acc;
  using Op = typename P::Op;
  const int64_t H = x.heads, D = x.head_dim, Dp = pol.pad(D);
  const int64_t threads = at::get_num_threads();
  const PassPlan plan = plan_pass(b, causal, bq, bk, H, threads, Walk::kQueryTiles);
  const std::vector<Unit>& units = plan.units;
  const int64_t most_key_tiles = plan.most_key_tiles;
  const int64_t pack = Dp * bk;  // one key tile of K^T or V
  const int64_t per_thread = 64 * 12 + sizeof(Op) * (most_key_tiles * pack * (P::kCopiesRowsB ? 2 : 1) + bq * Dp +
                                                     bq * bk) +
                             sizeof(Acc) * (bq * bk + bq * Dp + 3 * bq) + sizeof(int32_t) * bq;
  const Acc scale2 = static_cast<Acc>(scale * kLog2e);
  std::atomic<size_t> next{0};

  parallel_with_arenas(threads, per_thread, [&](int64_t, Arena& arena) {
    if constexpr (std::is_same_v<P, tiles::AmxPolicy>) tiles::amx_begin();
    for (size_t n = next++; n < units.size(); n = next++) {
      const Unit& u = units[n];
      const Geometry g = geometry_of(b, u.sample, causal, bq, bk);
      const int64_t cq = b.q[u.sample], ck = b.k[u.sample], h = u.head;
      arena.reset();
      // Keys used by the unit's last query, packed once for all of its query tiles.
      const int64_t key_tiles = (g.key_end(std::min(g.lq, u.end * bq) - 1) + bk - 1) / bk;
      Op* kt_pack = arena.take<Op>(key_tiles * pack);
      Op* v_pack = P::kCopiesRowsB ? arena.take<Op>(key_tiles * pack) : nullptr;
      std::vector<const Op*> kt(key_tiles), vt(key_tiles);
      std::vector<int64_t> ld_kt(key_tiles), ld_v(key_tiles);
      for (int64_t j = 0; j < key_tiles; ++j) {
        const int64_t c0 = j * bk, nk = std::min(bk, g.lk - c0);
        kt[j] = pol.rows_bt(x.k + (ck + c0) * x.sk0 + h * x.sk1, x.sk0, nk, D, kt_pack + j * pack, &ld_kt[j]);
        vt[j] = pol.rows_b(x.v + (ck + c0) * x.sv0 + h * x.sv1, x.sv0, nk, D, v_pack ? v_pack + j * pack : nullptr,
                           &ld_v[j]);
      }
      Op* q_copy = arena.take<Op>(bq * Dp);
      Op* p_op = arena.take<Op>(bq * bk);
      Acc* s = arena.take<Acc>(bq * bk);
      Acc* o = arena.take<Acc>(bq * Dp);
      Acc* m2 = arena.take<Acc>(bq);
      Acc* l = arena.take<Acc>(bq);
      Acc* alpha = arena.take<Acc>(bq);
      int32_t* limit = arena.take<int32_t>(bq);
      for (int64_t i = u.begin; i < u.end; ++i) {
        const int64_t r0 = i * bq, mq = std::min(bq, g.lq - r0), mq_p = pol.pad(mq);
        int64_t lda = 0;
        const Op* qa = pol.rows_a(x.q + (cq + r0) * x.sq0 + h * x.sq1, x.sq0, mq, mq_p, D, q_copy, &lda);
        std::fill(m2, m2 + mq_p, -std::numeric_limits<Acc>::infinity());
        std::fill(l, l + mq_p, Acc(0));
        std::fill(o, o + mq_p * Dp, Acc(0));
        const int64_t tiles_j = g.key_tiles_of_q_tile(i);
        for (int64_t j = 0; j < tiles_j; ++j) {
          const int64_t c0 = j * bk, nk = std::min(bk, g.lk - c0), nk_p = pol.pad(nk);
          // Lines 8-10: S = Q_i K_j^T, online softmax, O = diag(alpha) O + P V_j.
          pol.gemm(mq_p, nk_p, Dp, qa, lda, kt[j], ld_kt[j], s, bk, false);
          for (int64_t r = 0; r < mq_p; ++r) {
            limit[r] = static_cast<int32_t>(r < mq ? std::clamp<int64_t>(g.key_end(r0 + r) - c0, 0, nk) : 0);
          }
          pol.online_softmax(s, bk, mq_p, nk_p, limit, scale2, m2, l, alpha);
          pol.scale_rows(o, Dp, mq, Dp, alpha);
          int64_t ldp = 0;
          const Op* pa = pol.tile_a(s, bk, mq_p, nk_p, p_op, &ldp);
          pol.gemm(mq_p, Dp, nk_p, pa, ldp, vt[j], ld_v[j], o, Dp, true);
        }
        // Lines 12-13: O_i = diag(l)^-1 O, L_i = m + log(l).
        for (int64_t r = 0; r < mq; ++r) {
          const int64_t row = cq + r0 + r;
          lse[row * H + h] = l[r] > 0 ? (m2[r] + std::log2(l[r])) * static_cast<Acc>(kLn2)
                                      : -std::numeric_limits<Acc>::infinity();
          alpha[r] = l[r] > 0 ? Acc(1) / l[r] : Acc(0);
        }
        pol.store_rows(o, Dp, mq, D, alpha, out + ((cq + r0) * H + h) * D, H * D);
      }
    }
    if constexpr (std::is_same_v<P, tiles::AmxPolicy>) tiles::amx_end();
  });
}

// ---- backward (FlashAttention-2 Algorithm 2) -----------------------------------------------------------------

template <class P>
struct BackwardInputs {
  const typename P::In* dout;
  const typename P::In* out;
  const typename P::Acc* lse;
  int64_t so0, so1, sd0, sd1;  // token and head strides of out and dout; lse is [Tq, H] contiguous
};

// A (sample, head) split over several backward units: each unit's dq share has its own rows, summed in piece
// order by whichever unit finishes last, so that the result does not depend on the order units finish in.
template <class Acc>
struct SplitDq {
  explicit SplitDq(int64_t pieces) : remaining(pieces), shares(static_cast<size_t>(pieces)),
                                     bases(static_cast<size_t>(pieces)) {}
  std::atomic<int64_t> remaining;
  std::vector<Acc*> shares;     // [rows from bases[p], padded to whole query tiles] x Dp
  std::vector<int64_t> bases;   // first query row of each share
};

// What every unit of one backward pass reads: the operands, the forward's results, the tiles and the outputs.
template <class P>
struct BackwardPass {
  const P& pol;
  const Operands<P>& x;
  const BackwardInputs<P>& y;
  const VarlenBounds& b;
  bool causal;
  int64_t bq, bk;
  typename P::Acc scale2, acc_scale;  // scale / ln 2 for exp2, and the score scale
  typename P::In* dq;
  typename P::In* dk;
  typename P::In* dv;
  const std::vector<std::unique_ptr<SplitDq<typename P::Acc>>>& splits;
  // The first query row of the unit's keys (whole query tiles): where its dq rows start.
  int64_t first_row(const Unit& u) const {
    return geometry_of(b, u.sample, causal, bq, bk).first_q_tile_of_k_tile(u.begin) * bq;
  }
};

// The last unit of a split (sample, head) to finish sums the dq shares in piece order and stores them.
template <class P>
void finish_split(const BackwardPass<P>& c, const Geometry& g, SplitDq<typename P::Acc>* split, int64_t cq,
                  int64_t h) {
  using Acc = typename P::Acc;
  const int64_t H = c.x.heads, D = c.x.head_dim, Dp = c.pol.pad(D);
  // acq_rel: the last unit sees every other unit's share.
  if (split == nullptr || split->remaining.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  // Into the first share (it starts at row 0 of the sample's first key range): its rows are the superset.
  Acc* total = split->shares[0];
  for (size_t p = 1; p < split->shares.size(); ++p) {
    const int64_t from = split->bases[p] - split->bases[0];
    for (int64_t e = 0; e < (g.lq - split->bases[p]) * Dp; ++e) total[from * Dp + e] += split->shares[p][e];
  }
  c.pol.store_rows(total, Dp, g.lq - split->bases[0], D, nullptr, c.dq + ((cq + split->bases[0]) * H + h) * D,
                   H * D);
}

// One backward unit: the key tiles [u.begin, u.end) of one (sample, head) with every query tile that attends
// them (FlashAttention-2 Algorithm 2, the loop over j with the inner loop over i).
template <class P>
void backward_unit(const BackwardPass<P>& c, const Unit& u, Arena& arena) {
  using Acc = typename P::Acc;
  using Op = typename P::Op;
  using In = typename P::In;
  const P& pol = c.pol;
  const Operands<P>& x = c.x;
  const BackwardInputs<P>& y = c.y;
  const int64_t bq = c.bq, bk = c.bk, H = x.heads, D = x.head_dim, Dp = pol.pad(D);
  const int64_t tile = bq * bk, kpack = Dp * bk;
  In* const dq = c.dq;
  const Geometry g = geometry_of(c.b, u.sample, c.causal, bq, bk);
  const int64_t cq = c.b.q[u.sample], ck = c.b.k[u.sample], h = u.head;
  arena.reset();
  // Queries that attend the unit's keys: whole query tiles from the first one on.
  const int64_t base = c.first_row(u);
  SplitDq<Acc>* split = u.split < 0 ? nullptr : c.splits[static_cast<size_t>(u.split)].get();

  if (u.piece == 0) {  // queries before the first one that attends a key: no gradient
    for (int64_t r = 0; r < std::min(base, g.lq); ++r) std::fill_n(dq + ((cq + r) * H + h) * D, D, In(0));
  }
  if (base >= g.lq) {
    finish_split(c, g, split, cq, h);
    return;
  }
  const int64_t rows = g.lq - base, rows_p = round_up(rows, bq);
  Acc* lse2 = arena.take<Acc>(rows_p);
  Acc* dlt = arena.take<Acc>(rows_p);
  // Line 4 of Algorithm 2: D_i = rowsum(dO_i * O_i). Padding rows get no probability mass, no gradient.
  pol.row_dots(y.out + (cq + base) * y.so0 + h * y.so1, y.so0, y.dout + (cq + base) * y.sd0 + h * y.sd1, y.sd0,
               rows, D, dlt);
  for (int64_t r = 0; r < rows_p; ++r) {
    lse2[r] = r < rows ? y.lse[(cq + base + r) * H + h] * static_cast<Acc>(kLog2e)
                       : std::numeric_limits<Acc>::infinity();
    if (r >= rows) dlt[r] = 0;
  }
  // Q^T and dO^T are the A operands of dK^T += Q^T dS and dV^T += dO^T P, built once per unit.
  Op* qt = arena.take<Op>(Dp * rows_p);
  Op* dot = arena.take<Op>(Dp * rows_p);
  std::fill(qt, qt + Dp * rows_p, Op(0));
  std::fill(dot, dot + Dp * rows_p, Op(0));
  pol.rows_t(x.q + (cq + base) * x.sq0 + h * x.sq1, x.sq0, rows, D, qt, rows_p);
  pol.rows_t(y.dout + (cq + base) * y.sd0 + h * y.sd1, y.sd0, rows, D, dot, rows_p);
  Acc* dq_acc = split ? split->shares[static_cast<size_t>(u.piece)] : arena.take<Acc>(rows_p * Dp);
  if (!split) std::fill(dq_acc, dq_acc + rows_p * Dp, Acc(0));
  Op* kt_pack = arena.take<Op>(kpack);
  Op* vt_pack = arena.take<Op>(kpack);
  Op* kb_pack = arena.take<Op>(kpack);
  Acc* dkt = arena.take<Acc>(kpack);
  Acc* dvt = arena.take<Acc>(kpack);
  Op* q_copy = arena.take<Op>(bq * Dp);
  Op* do_copy = arena.take<Op>(bq * Dp);
  Acc* s = arena.take<Acc>(tile);
  Acc* dp = arena.take<Acc>(tile);
  Op* ds_a = arena.take<Op>(tile);
  Op* p_b = arena.take<Op>(tile);
  Op* ds_b = arena.take<Op>(tile);
  int32_t* limit = arena.take<int32_t>(bq);
  for (int64_t j = u.begin; j < u.end; ++j) {
    const int64_t c0 = j * bk, nk = std::min(bk, g.lk - c0), nk_p = pol.pad(nk);
    int64_t ld_kt = 0, ld_vt = 0, ld_kb = 0;
    const In* k_rows = x.k + (ck + c0) * x.sk0 + h * x.sk1;
    const Op* ktj = pol.rows_bt(k_rows, x.sk0, nk, D, kt_pack, &ld_kt);
    const Op* vtj = pol.rows_bt(x.v + (ck + c0) * x.sv0 + h * x.sv1, x.sv0, nk, D, vt_pack, &ld_vt);
    const Op* kbj = pol.rows_b(k_rows, x.sk0, nk, D, kb_pack, &ld_kb);
    std::fill(dkt, dkt + Dp * nk_p, Acc(0));
    std::fill(dvt, dvt + Dp * nk_p, Acc(0));
    for (int64_t i = g.first_q_tile_of_k_tile(j); i < g.q_tiles(); ++i) {
      const int64_t r0 = i * bq, mq = std::min(bq, g.lq - r0), mq_p = pol.pad(mq), at = r0 - base;
      int64_t ld_q = 0, ld_do = 0;
      const Op* qa = pol.rows_a(x.q + (cq + r0) * x.sq0 + h * x.sq1, x.sq0, mq, mq_p, D, q_copy, &ld_q);
      const Op* doa = pol.rows_a(y.dout + (cq + r0) * y.sd0 + h * y.sd1, y.sd0, mq, mq_p, D, do_copy, &ld_do);
      // Lines 8-11: S = Q_i K_j^T, P = exp(S - L_i), dP = dO_i V_j^T; lines 12-14: dS = P * (dP - D_i).
      pol.gemm(mq_p, nk_p, Dp, qa, ld_q, ktj, ld_kt, s, bk, false);
      pol.gemm(mq_p, nk_p, Dp, doa, ld_do, vtj, ld_vt, dp, bk, false);
      for (int64_t r = 0; r < mq_p; ++r) {
        limit[r] = static_cast<int32_t>(r < mq ? std::clamp<int64_t>(g.key_end(r0 + r) - c0, 0, nk) : 0);
      }
      pol.softmax_grad(s, dp, bk, mq_p, nk_p, limit, c.scale2, c.acc_scale, lse2 + at, dlt + at);
      // Lines 10, 15-16: dV_j += P^T dO_i, dQ_i += dS K_j, dK_j += dS^T Q_i (dV, dK kept transposed).
      int64_t ld_dsa = 0, ld_pb = 0, ld_dsb = 0;
      const Op* dsa = pol.tile_a(dp, bk, mq_p, nk_p, ds_a, &ld_dsa);
      pol.gemm(mq_p, Dp, nk_p, dsa, ld_dsa, kbj, ld_kb, dq_acc + at * Dp, Dp, true);
      const Op* pb = pol.tile_b(s, bk, mq_p, nk_p, p_b, &ld_pb);
      pol.gemm(Dp, nk_p, mq_p, dot + at, rows_p, pb, ld_pb, dvt, nk_p, true);
      const Op* dsb = pol.tile_b(dp, bk, mq_p, nk_p, ds_b, &ld_dsb);
      pol.gemm(Dp, nk_p, mq_p, qt + at, rows_p, dsb, ld_dsb, dkt, nk_p, true);
    }
    pol.store_transposed(dkt, nk_p, nk, D, c.dk + ((ck + c0) * H + h) * D, H * D);
    pol.store_transposed(dvt, nk_p, nk, D, c.dv + ((ck + c0) * H + h) * D, H * D);
  }
  if (split) {
    finish_split(c, g, split, cq, h);
    return;
  }
  pol.store_rows(dq_acc, Dp, rows, D, nullptr, dq + ((cq + base) * H + h) * D, H * D);
}

template <class P>
void backward_pass(const P& pol, const Operands<P>& x, const BackwardInputs<P>& y, const VarlenBounds& b,
                   bool causal, double scale, int64_t bq, int64_t bk, typename P::In* dq, typename P::In* dk,
                   typename P::In* dv) {
  using Acc = typename P::Acc;
  using Op = typename P::Op;
  const int64_t H = x.heads, D = x.head_dim, Dp = pol.pad(D);
  const int64_t threads = at::get_num_threads();
  PassPlan plan = plan_pass(b, causal, bq, bk, H, threads, Walk::kKeyTiles);
  std::vector<Unit>& units = plan.units;
  const int64_t most_rows = plan.most_rows;
  std::vector<std::unique_ptr<SplitDq<Acc>>> splits;
  const BackwardPass<P> c{pol, x, y, b, causal, bq, bk, static_cast<Acc>(scale * kLog2e), static_cast<Acc>(scale),
                          dq, dk, dv, splits};
  // Where a (sample, head) is split, its units write their dq shares to storage of their own.
  auto first_row = [&](const Unit& u) { return c.first_row(u); };
  std::vector<int64_t> pieces(static_cast<size_t>(b.samples() * H), 0), split_of(pieces.size(), -1);
  for (const Unit& u : units) ++pieces[u.sample * H + u.head];
  int64_t share_elems = 0;
  for (Unit& u : units) {
    const size_t sh = static_cast<size_t>(u.sample * H + u.head);
    if (pieces[sh] < 2) continue;
    if (split_of[sh] < 0) {
      split_of[sh] = static_cast<int64_t>(splits.size());
      splits.push_back(std::make_unique<SplitDq<Acc>>(pieces[sh]));
    }
    u.split = split_of[sh];
    share_elems += round_up(std::max<int64_t>(0, b.q_len(u.sample) - first_row(u)), bq) * Dp;
  }
  torch::Tensor share_storage;
  if (share_elems > 0) {
    share_storage = torch::zeros({share_elems * static_cast<int64_t>(sizeof(Acc))}, torch::kUInt8);
    Acc* next_share = reinterpret_cast<Acc*>(share_storage.data_ptr());
    for (const Unit& u : units) {
      if (u.split < 0) continue;
      SplitDq<Acc>& sp = *splits[static_cast<size_t>(u.split)];
      sp.shares[static_cast<size_t>(u.piece)] = next_share;
      sp.bases[static_cast<size_t>(u.piece)] = first_row(u);
      next_share += round_up(std::max<int64_t>(0, b.q_len(u.sample) - first_row(u)), bq) * Dp;
    }
  }

  const int64_t tile = bq * bk, kpack = Dp * bk;
  const int64_t per_thread = 64 * 20 + sizeof(Acc) * (2 * most_rows + most_rows * Dp + 2 * kpack + 2 * tile) +
                             sizeof(Op) * (2 * Dp * most_rows + 3 * kpack + 2 * bq * Dp + 3 * tile) +
                             sizeof(int32_t) * bq;
  std::atomic<size_t> next{0};

  parallel_with_arenas(threads, per_thread, [&](int64_t, Arena& arena) {
    if constexpr (std::is_same_v<P, tiles::AmxPolicy>) tiles::amx_begin();
    for (size_t n = next++; n < units.size(); n = next++) backward_unit(c, units[n], arena);
    if constexpr (std::is_same_v<P, tiles::AmxPolicy>) tiles::amx_end();
  });
}

// ---- dispatch ------------------------------------------------------------------------------------------------

struct Plan {
  VarlenBounds bounds;
  double scale;
};

Plan check(const char* who, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
           const torch::Tensor& cu_q, const torch::Tensor& cu_k, const AttentionOptions& options) {
  Plan p{check_varlen(who, q, k, v, cu_q, cu_k), attention_scale(who, options.scale, q.size(2))};
  if (!q.device().is_cpu()) {
    throw std::invalid_argument(fmt::format("{}: the tiled operator runs on the CPU (q is on {})", who,
                                            q.device().str()));
  }
  if (options.tile_q < 1 || options.tile_k < 1 || options.tile_q > 4096 || options.tile_k > 4096) {
    throw std::invalid_argument(fmt::format("{}: tile sizes must be in [1, 4096] (tile_q {}, tile_k {})", who,
                                            options.tile_q, options.tile_k));
  }
  return p;
}

bool use_amx(const torch::Tensor& q, const AttentionOptions& options) {
  return !options.portable && q.scalar_type() == torch::kBFloat16 && q.size(2) % 2 == 0 && amx_usable();
}

// Calls fn(policy) with the policy for q's dtype; bf16 without AMX runs the fp32 policy on upcast copies
// (the caller's `upcast` path), so fn is only called with bf16 tensors for the AMX policy.
template <class Fn>
void with_policy(const torch::Tensor& q, const AttentionOptions& options, Fn fn) {
  switch (q.scalar_type()) {
    case torch::kDouble: return fn(tiles::RowMajorPolicy<double>{});
    case torch::kFloat: {
      tiles::RowMajorPolicy<float> pol;
      pol.simd = !options.portable && avx512_usable();
      return fn(pol);
    }
    default: return fn(tiles::AmxPolicy{});
  }
}

int64_t tile_size(int64_t requested, int64_t align) { return round_up(requested, align); }

}  // namespace

AttentionResult tiled_attention_forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                        const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k,
                                        bool causal, const AttentionOptions& options) {
  const Plan plan = check("tiled_attention_forward", q, k, v, cu_seqlens_q, cu_seqlens_k, options);
  if (q.scalar_type() == torch::kBFloat16 && !use_amx(q, options)) {
    auto r = tiled_attention_forward(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat), cu_seqlens_q,
                                     cu_seqlens_k, causal, options);
    return {r.out.to(torch::kBFloat16), r.lse};
  }
  const auto lse_type = q.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  // Every row of a sample with keys is written by the pass; those of key-less samples are set here.
  torch::Tensor out = torch::empty(q.sizes(), q.options());
  torch::Tensor lse = torch::empty({q.size(0), q.size(1)}, q.options().dtype(lse_type));
  for (int64_t s = 0; s < plan.bounds.samples(); ++s) {
    if (plan.bounds.k_len(s) > 0) continue;
    out.slice(0, plan.bounds.q[s], plan.bounds.q[s + 1]).zero_();
    lse.slice(0, plan.bounds.q[s], plan.bounds.q[s + 1]).fill_(-std::numeric_limits<double>::infinity());
  }
  torch::NoGradGuard no_grad;
  with_policy(q, options, [&](auto pol) {
    using P = decltype(pol);
    const int64_t bq = tile_size(options.tile_q, P::kAlign), bk = tile_size(options.tile_k, P::kAlign);
    forward_pass(pol, operands_of<P>(q, k, v), plan.bounds, causal, plan.scale, bq, bk,
                 out.data_ptr<typename P::In>(), lse.data_ptr<typename P::Acc>());
  });
  return {out, lse};
}

AttentionGrads tiled_attention_backward(const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k,
                                        const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse,
                                        const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k,
                                        bool causal, const AttentionOptions& options) {
  const Plan plan = check("tiled_attention_backward", q, k, v, cu_seqlens_q, cu_seqlens_k, options);
  const auto lse_type = q.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  if (dout.sizes() != q.sizes() || out.sizes() != q.sizes() || dout.scalar_type() != q.scalar_type() ||
      out.scalar_type() != q.scalar_type()) {
    throw std::invalid_argument(fmt::format("tiled_attention_backward: dout {} and out {} must match q {} in shape "
                                            "and dtype",
                                            c10::str(dout.sizes()), c10::str(out.sizes()), c10::str(q.sizes())));
  }
  if (lse.sizes() != q.sizes().slice(0, 2) || lse.scalar_type() != lse_type) {
    throw std::invalid_argument(fmt::format("tiled_attention_backward: lse must be [{}, {}] {} (got {} {})",
                                            q.size(0), q.size(1), c10::toString(lse_type), c10::str(lse.sizes()),
                                            c10::toString(lse.scalar_type())));
  }
  if (q.scalar_type() == torch::kBFloat16 && !use_amx(q, options)) {
    const auto f = [](const torch::Tensor& t) { return t.to(torch::kFloat); };
    auto g = tiled_attention_backward(f(dout), f(q), f(k), f(v), f(out), lse, cu_seqlens_q, cu_seqlens_k, causal,
                                      options);
    return {g.dq.to(torch::kBFloat16), g.dk.to(torch::kBFloat16), g.dv.to(torch::kBFloat16)};
  }
  torch::NoGradGuard no_grad;
  const torch::Tensor dout_c = dout.stride(2) == 1 ? dout : dout.contiguous();
  const torch::Tensor out_c = out.stride(2) == 1 ? out : out.contiguous();
  const torch::Tensor lse_c = lse.contiguous();
  // The pass writes dk, dv of every key of a sample with queries and dq from each head's first attending query
  // tile on; the rest (samples without queries or keys, queries before the first key) is zeroed here and there.
  torch::Tensor dq = torch::empty(q.sizes(), q.options());
  torch::Tensor dk = torch::empty(k.sizes(), k.options());
  torch::Tensor dv = torch::empty(v.sizes(), v.options());
  for (int64_t s = 0; s < plan.bounds.samples(); ++s) {
    if (plan.bounds.k_len(s) > 0 && plan.bounds.q_len(s) > 0) continue;
    dq.slice(0, plan.bounds.q[s], plan.bounds.q[s + 1]).zero_();
    dk.slice(0, plan.bounds.k[s], plan.bounds.k[s + 1]).zero_();
    dv.slice(0, plan.bounds.k[s], plan.bounds.k[s + 1]).zero_();
  }
  with_policy(q, options, [&](auto pol) {
    using P = decltype(pol);
    using In = typename P::In;
    const int64_t bq = tile_size(options.tile_q, P::kAlign), bk = tile_size(options.tile_k, P::kAlign);
    const BackwardInputs<P> y{dout_c.data_ptr<In>(), out_c.data_ptr<In>(), lse_c.data_ptr<typename P::Acc>(),
                              out_c.stride(0), out_c.stride(1), dout_c.stride(0), dout_c.stride(1)};
    backward_pass(pol, operands_of<P>(q, k, v), y, plan.bounds, causal, plan.scale, bq, bk, dq.data_ptr<In>(),
                  dk.data_ptr<In>(), dv.data_ptr<In>());
  });
  return {dq, dk, dv};
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct TiledAttentionFunction : torch::autograd::Function<TiledAttentionFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& cu_q, const torch::Tensor& cu_k,
                               bool causal, double scale, int64_t tile_q, int64_t tile_k, bool portable) {
    const AttentionOptions options{scale, tile_q, tile_k, portable};
    AttentionResult r = tiled_attention_forward(q, k, v, cu_q, cu_k, causal, options);
    ctx->save_for_backward({q, k, v, r.out, r.lse, cu_q, cu_k});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["tile_q"] = tile_q;
    ctx->saved_data["tile_k"] = tile_k;
    ctx->saved_data["portable"] = portable;
    return r.out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const AttentionOptions options{ctx->saved_data["scale"].toDouble(), ctx->saved_data["tile_q"].toInt(),
                                   ctx->saved_data["tile_k"].toInt(), ctx->saved_data["portable"].toBool()};
    AttentionGrads g = tiled_attention_backward(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4],
                                                saved[5], saved[6], ctx->saved_data["causal"].toBool(), options);
    return {g.dq, g.dk, g.dv, {}, {}, {}, {}, {}, {}, {}};
  }
};

}  // namespace

torch::Tensor tiled_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& cu_seqlens_q, const torch::Tensor& cu_seqlens_k, bool causal,
                              const AttentionOptions& options) {
  return TiledAttentionFunction::apply(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, options.scale, options.tile_q,
                                       options.tile_k, options.portable);
}

}  // namespace dcp
