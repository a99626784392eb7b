// The fused chunked kernel of Flexformer's causal linear attention, forward and backward, outside autograd
// (include/dcp/linear_attention.h; docs/flexformer.md "The fused kernel"). The shape is fla's fused_chunk
// (fla/ops/linear_attn/fused_chunk.py, via simple_gla): one pass over the chunks of each (sequence, head) carrying
// the state; the backward is the chunked form of Katharopoulos et al. 2020, section 3.3.1 (the gradient as
// cumulative sums, forward for dq and in reverse for dk, dv), with the input conditioning, feature map and
// normaliser of Flexformer fused in. The tile products are kernels/attention's (tiles.h, via fused_tiles.h).
//
// Notation per (sequence, head) and chunk of n <= C tokens (transposed tiles have one row per feature or channel
// and one column per token, leading dimension C):
//   a = g x (conditioned q), b likewise for k;  P^T = phi(a)^T [F x n], R^T = w phi(b)^T (key weight w, 1 if none);
//   the shift feature alpha is kept out of the tiles as a rank-1 term: phi_q = [alpha; P], phi_k = w [alpha; R/w];
//   state S [F x d], z [F], and the shift row S0 [d], z0 (so that F stays a multiple of 32 for the tiles).
// Forward (per chunk):  Sc = mask(P R^T + alpha^2 w^T)           (intra-chunk scores, lower triangle)
//                       O = Sc V + P S + alpha 1 S0^T,  den = Sc 1 + P z + alpha z0
//                       S += R^T V, z += R^T 1, S0 += alpha V^T w, z0 += alpha w^T 1
//                       y = O / (den + eps) | O / max(den, eps) | O rsqrt(mean O^2 + eps)
// Backward: dn, dden from dy, y and the saved den (or RMS factor); then
//   sweep 1 (chunks in order, state as in the forward, before the chunk's own update):
//       dSc^T = mask(V dn^T + 1 dden^T);  dP^T = R^T dSc^T + S dn^T + z dden^T  -> dq, dOmega
//   sweep 2 (chunks in reverse, dS = sum over later tokens of P dn^T, dz of P dden):
//       dSc = mask(dn V^T + dden 1^T);  dR^T = P^T dSc + dS V^T + dz 1^T          -> dk, dOmega
//       dV = Sc^T dn + R dS + alpha w dS0^T;  then dS += P^T dn, dz += P^T dden, ...
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "dcp/cpu_features.h"
#include "dcp/linear_attention.h"
#include "kernels/attention/arena.h"
#include "kernels/linear_attention/fused_tiles.h"

namespace dcp {
namespace {

using linear_attention::fused::Bf16Policy;
using linear_attention::fused::RowPolicy;
using linear_attention::fused::View;
using tiles::Arena;
using tiles::parallel_with_arenas;

// ---- shapes, parameters, inputs -----------------------------------------------------------------------------

struct Shape {
  int64_t heads = 0, d = 0, m = 0, F = 0, C = 0;  // F: feature rows of the tiles (2m or d), without alpha
  FeatureMap map = FeatureMap::kStationary;
  InputNorm norm = InputNorm::kL2;
  Normalizer normalizer = Normalizer::kShift;
  bool shift = false, key_weight = false, trig = false, pair = false, has_den = false;
  bool omega_grad = false;  // the frequencies' gradients are wanted

  // A state (or its gradient, or a range's sum) as one array: S [F x d], z [F], S0 [d], z0.
  int64_t state_len() const { return F * d + F + d + 1; }
  int64_t z_at() const { return F * d; }
  int64_t s0_at() const { return F * d + F; }
  int64_t z0_at() const { return F * d + F + d; }
  // One head's parameter gradients as one array: dOmega [m x d], dOmega2 [m x d], dalpha.
  int64_t grad_len() const { return (trig ? m * d * (pair ? 2 : 1) : 0) + 1; }
  int64_t domega2_at() const { return m * d; }
  int64_t dalpha_at() const { return grad_len() - 1; }
};

template <class T>
struct Params {
  std::vector<T> omega, omega2, alpha, offset;  // [H m d], [H m d], [H], [H] (empty when not used)
  T scale = 1;   // of the trig features: m^-1/2 (stationary), (4m)^-1/2 (nonstationary)
  T c0 = 1;      // d^-1/4 (rms, scale)
  T kappa = 0;   // conditioning backward: dx = g (da - kappa a (a . da)); 1 (l2), d^-1/2 (rms), 0 (scale)
};

template <class In, class T>
struct Io {
  const In* q = nullptr;
  const In* k = nullptr;
  const In* v = nullptr;
  int64_t sq0 = 0, sq1 = 0, sk0 = 0, sk1 = 0, sv0 = 0, sv1 = 0;  // token and head strides
  const std::vector<int64_t>* bounds = nullptr;
  // forward
  In* out = nullptr;     // [T, H, d] contiguous
  In* out_lo = nullptr;  // [T, H, d] contiguous: out's rounding residual (bf16 only)
  T* stat = nullptr;     // [T, H]
  // backward
  const In* dout = nullptr;
  const In* y = nullptr;     // the forward's out
  const In* y_lo = nullptr;  // and its residual (contiguous), bf16 only
  int64_t sg0 = 0, sg1 = 0, sy0 = 0, sy1 = 0;
  const T* stat_in = nullptr;
  T* dden = nullptr;  // [T, H]: dden per token (has_den), written by the backward's first sweep, read by its second
  In* dq = nullptr;  // [T, H, d] contiguous each
  In* dk = nullptr;
  In* dv = nullptr;
};

// ---- work split ----------------------------------------------------------------------------------------------

// A range of chunks [c0, c1) of one (sequence, head).
struct Unit {
  int64_t seq = 0, head = 0, c0 = 0, c1 = 0;
  int64_t piece = 0, pieces = 1;  // index among its (sequence, head)'s ranges, and their count
  int64_t group = -1;             // the split (sequence, head) it belongs to, -1 when unsplit
  int64_t slot = -1;              // its start state's (and end state gradient's) slot when split
  int64_t work = 0;               // tokens
};

struct UnitPlan {
  std::vector<Unit> units;
  std::vector<std::vector<int64_t>> groups;  // per split (sequence, head): unit indices in piece order
  std::vector<std::vector<int64_t>> of_thread;  // unit indices each thread runs, in order
  int64_t slots = 0;
};

// Units over (sequence, head), a (sequence, head) longer than half of one thread's share of all tokens cut into
// ranges of about that share (as the tiled softmax splits a long sample), then assigned to threads longest first,
// each to the least loaded thread (LPT). The assignment is static, so the parameter gradients each thread sums
// (and their sum over threads in thread order) are the same bits for a given thread count.
UnitPlan plan_units(const std::vector<int64_t>& bounds, int64_t heads, int64_t chunk, int64_t threads) {
  UnitPlan plan;
  int64_t total = 0;
  for (size_t i = 0; i + 1 < bounds.size(); ++i) total += (bounds[i + 1] - bounds[i]) * heads;
  const int64_t target = threads > 1 ? std::max<int64_t>(chunk, total / (2 * threads)) : total + 1;
  for (size_t i = 0; i + 1 < bounds.size(); ++i) {
    const int64_t len = bounds[i + 1] - bounds[i];
    if (len <= 0) continue;
    const int64_t chunks = (len + chunk - 1) / chunk;
    const int64_t pieces = len > target ? std::min<int64_t>(chunks, (len + target - 1) / target) : 1;
    for (int64_t h = 0; h < heads; ++h) {
      std::vector<int64_t> members;
      const int64_t group = pieces > 1 ? static_cast<int64_t>(plan.groups.size()) : -1;
      for (int64_t p = 0; p < pieces; ++p) {
        Unit u;
        u.seq = static_cast<int64_t>(i);
        u.head = h;
        u.c0 = p * chunks / pieces;
        u.c1 = (p + 1) * chunks / pieces;
        u.piece = p;
        u.pieces = pieces;
        u.group = group;
        u.slot = pieces > 1 ? plan.slots++ : -1;
        u.work = std::min(len, u.c1 * chunk) - u.c0 * chunk;
        members.push_back(static_cast<int64_t>(plan.units.size()));
        plan.units.push_back(u);
      }
      if (pieces > 1) plan.groups.push_back(members);
    }
  }
  std::vector<int64_t> order(plan.units.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return plan.units[a].work > plan.units[b].work; });
  plan.of_thread.resize(static_cast<size_t>(threads));
  std::vector<int64_t> load(static_cast<size_t>(threads), 0);
  for (int64_t u : order) {
    const size_t t = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    plan.of_thread[t].push_back(u);
    load[t] += plan.units[u].work;
  }
  return plan;
}

// ---- one thread's tiles ----------------------------------------------------------------------------------------

template <class T>
struct Feat {     // one chunk's conditioned inputs and features of q or k
  T* x = nullptr;   // [C x d] raw rows
  T* a = nullptr;   // [C x d] conditioned rows
  T* at = nullptr;  // [d x C]
  T* g = nullptr;   // [C] a = g x
  T* w = nullptr;   // [C] key weight (1 when none)
  T* u = nullptr;   // [m x C] Omega a (trig)
  T* u2 = nullptr;  // [m x C] Omega2 a (nonstationary)
  T *c1 = nullptr, *s1 = nullptr, *c2 = nullptr, *s2 = nullptr;  // [m x C] cos, sin of u, u2 (nonstationary)
  T* pt = nullptr;  // [F x C] phi^T
  T* rt = nullptr;  // [F x C] w phi^T (== pt without a key weight)
  T* rt_buf = nullptr;
};

template <class P>
struct Tiles {
  using T = typename P::Acc;
  using Op = typename P::Op;
  static constexpr int kPacks = 8;
  Feat<T> q, k;
  T *vr, *vt, *o, *den, *sc, *dsc, *dpt, *dn, *dnt, *dden, *dy, *yr, *du, *du2, *da, *dvr, *col, *ex;
  T *state, *dstate;
  Op* pack[kPacks];
  T* ctmp;
};

// Elements of one pack buffer / ctmp: every operand is [r x c] with r, c among F, C, d.
int64_t pack_capacity(const Shape& s) {
  const int64_t big = std::max({s.F, s.C, s.d}), small = std::max(s.C, s.d);
  return Bf16Policy::pack_elems(big, small);
}

template <class P>
int64_t tile_bytes(const Shape& s) {
  using T = typename P::Acc;
  using Op = typename P::Op;
  const int64_t C = s.C, d = s.d, m = std::max<int64_t>(s.m, 1), F = s.F;
  const int64_t feat = 2 * C * d + d * C + 2 * C + 2 * m * C + 4 * m * C + 2 * F * C;
  const int64_t rest = C * d + d * C + C * d + C + 2 * C * C + F * C + C * d + d * C + C + 2 * C * d + 2 * m * C +
                       d * C + C * d + 2 * C;
  const int64_t blocks = 2 * 13 + 18 + 2 + Tiles<P>::kPacks + 1;
  const int64_t cap = P::kPacks ? pack_capacity(s) : 0;
  return static_cast<int64_t>(sizeof(T)) * (2 * feat + rest + 2 * s.state_len() + cap) +
         static_cast<int64_t>(sizeof(Op)) * Tiles<P>::kPacks * cap + 64 * blocks;
}

template <class P>
Tiles<P> take_tiles(const Shape& s, Arena& arena) {
  using T = typename P::Acc;
  using Op = typename P::Op;
  const int64_t C = s.C, d = s.d, m = std::max<int64_t>(s.m, 1), F = s.F;
  Tiles<P> t;
  for (Feat<T>* f : {&t.q, &t.k}) {
    f->x = arena.take<T>(C * d);
    f->a = arena.take<T>(C * d);
    f->at = arena.take<T>(d * C);
    f->g = arena.take<T>(C);
    f->w = arena.take<T>(C);
    f->u = arena.take<T>(m * C);
    f->u2 = arena.take<T>(m * C);
    f->c1 = arena.take<T>(m * C);
    f->s1 = arena.take<T>(m * C);
    f->c2 = arena.take<T>(m * C);
    f->s2 = arena.take<T>(m * C);
    f->pt = arena.take<T>(F * C);
    f->rt_buf = arena.take<T>(F * C);
    f->rt = f->pt;
  }
  t.vr = arena.take<T>(C * d);
  t.vt = arena.take<T>(d * C);
  t.o = arena.take<T>(C * d);
  t.den = arena.take<T>(C);
  t.sc = arena.take<T>(C * C);
  t.dsc = arena.take<T>(C * C);
  t.dpt = arena.take<T>(F * C);
  t.dn = arena.take<T>(C * d);
  t.dnt = arena.take<T>(d * C);
  t.dden = arena.take<T>(C);
  t.dy = arena.take<T>(C * d);
  t.yr = arena.take<T>(C * d);
  t.du = arena.take<T>(m * C);
  t.du2 = arena.take<T>(m * C);
  t.da = arena.take<T>(d * C);
  t.dvr = arena.take<T>(C * d);
  t.col = arena.take<T>(C);
  t.ex = arena.take<T>(C);
  t.state = arena.take<T>(s.state_len());
  t.dstate = arena.take<T>(s.state_len());
  const int64_t cap = P::kPacks ? pack_capacity(s) : 0;
  for (auto& p : t.pack) p = arena.take<Op>(cap);
  t.ctmp = arena.take<T>(cap);
  return t;
}

// ---- the chunk steps -------------------------------------------------------------------------------------------

// A software prefetch of the cache line at p into L2. Inline assembly, because GCC 12 at -O2 deletes loops whose
// only effect is __builtin_prefetch / _mm_prefetch (measured: none were left in the object file).
inline void prefetch_l2(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// What Chunks::prefetch fetches: the inputs, the backward's output gradient and saved output (kGrads) or the
// output gradient alone (kDout), outputs.
struct Fetches {
  static constexpr unsigned kQ = 1, kK = 2, kV = 4, kGrads = 8, kOut = 16, kDq = 32, kDk = 64, kDv = 128, kDout = 256;
};

template <class P, class In>
class Chunks {
 public:
  using T = typename P::Acc;

  Chunks(const Shape& s, const Params<T>& pr, const P& pol, bool simd, const Io<In, T>& io, Tiles<P>& t)
      : s_(s), pr_(pr), pol_(pol), fpol_{simd}, ops_{simd}, simd_(simd), io_(io), t_(t),
        prefix_(static_cast<size_t>(s.d)) {}

  // Asks for the cache lines of the head-h rows of tokens [t0, t0 + n) of the `what` tensors (Fetches bits) to
  // be brought into L2, so that the next chunk's rows arrive while this chunk computes: one head's row of a
  // [T, H, d] tensor is d elements every H d, and from 8K tokens on the tensors no longer fit in the last-level
  // cache. (A per-phase profile at 8K tokens, fp32, before: loading q, k, v, dout, y and storing out, dq, dk, dv
  // took about 30% of the kernel's time; the masked AVX-512 row loads are not followed by the hardware
  // prefetchers of the AMD EPYC measured.)
  void prefetch(int64_t t0, int64_t h, int64_t n, unsigned what) const {
    if (n <= 0) return;
    const int64_t row_bytes = s_.d * static_cast<int64_t>(sizeof(In));
    const int64_t ld = s_.heads * s_.d;
    auto rows = [&](const void* base, int64_t s0, int64_t s1) {
      if (base == nullptr) return;
      const char* p = static_cast<const char*>(base) + (t0 * s0 + h * s1) * static_cast<int64_t>(sizeof(In));
      const int64_t step = s0 * static_cast<int64_t>(sizeof(In));
      for (int64_t t = 0; t < n; ++t, p += step) {
        for (int64_t b = 0; b < row_bytes; b += 64) prefetch_l2(p + b);
      }
    };
    if (what & Fetches::kQ) rows(io_.q, io_.sq0, io_.sq1);
    if (what & Fetches::kK) rows(io_.k, io_.sk0, io_.sk1);
    if (what & Fetches::kV) rows(io_.v, io_.sv0, io_.sv1);
    if (what & (Fetches::kGrads | Fetches::kDout)) rows(io_.dout, io_.sg0, io_.sg1);
    if (what & Fetches::kGrads) {
      rows(io_.y, io_.sy0, io_.sy1);
      rows(io_.y_lo, ld, s_.d);
    }
    if (what & Fetches::kOut) {
      rows(io_.out, ld, s_.d);
      rows(io_.out_lo, ld, s_.d);
    }
    if (what & Fetches::kDq) rows(io_.dq, ld, s_.d);
    if (what & Fetches::kDk) rows(io_.dk, ld, s_.d);
    if (what & Fetches::kDv) rows(io_.dv, ld, s_.d);
  }

  // The next chunk's rows to prefetch while this chunk computes, a few tensors at a time (prefetch_next) between
  // its steps: issued all at once, the prefetches of 5-8 tensors' 256 lines each filled the miss queue and stalled
  // (the prefetch instructions took about 9% of the backward's time at 32K tokens).
  void plan_prefetch(int64_t t0, int64_t h, int64_t n, unsigned what) {
    pf_t0_ = t0, pf_h_ = h, pf_n_ = n, pf_what_ = what;
  }
  void prefetch_next(unsigned bits) {
    const unsigned now = pf_what_ & bits;
    if (now == 0) return;
    pf_what_ &= ~bits;
    prefetch(pf_t0_, pf_h_, pf_n_, now);
  }

  // Rows [n x d] (ld d) of the head-h, token-t0.. slice of a [T, H, d] tensor.
  void load(const In* base, int64_t s0, int64_t s1, int64_t t0, int64_t h, int64_t n, T* rows) const {
    ops_.load_rows(base + t0 * s0 + h * s1, s0, n, s_.d, rows, s_.d);
  }

  // Conditioning (docs/flexformer.md item 1) and the feature map (item 2) of one chunk's q or k.
  void features(Feat<T>& f, bool is_key, int64_t t0, int64_t h, int64_t n) const {
    const int64_t d = s_.d, C = s_.C, m = s_.m;
    if (!s_.trig) return elu_features(f, is_key, t0, h, n);
    if (is_key) {
      load(io_.k, io_.sk0, io_.sk1, t0, h, n, f.x);
    } else {
      load(io_.q, io_.sq0, io_.sq1, t0, h, n, f.x);
    }
    // a = g x: g = (|x|^2 + eps)^-1/2 (l2), d^-1/4 (mean x^2 + eps)^-1/2 (rms), d^-1/4 (scale).
    for (int64_t t = 0; t < n; ++t) {
      const T ss = ops_.dot(f.x + t * d, f.x + t * d, d);
      const T g = conditioning_gain(ss);
      f.g[t] = g;
      f.w[t] = T(0.5) * g * g * ss;  // |a|^2 / 2, for the key weight
    }
    ops_.store_rows(f.x, d, n, d, f.g, f.a, d);
    ops_.transpose(f.a, d, n, d, f.at, C);
    if (s_.trig) {
      // u^T = Omega a^T [m x n]; phi = scale [cos u; sin u] (or the nonstationary sum of two).
      const T* om = pr_.omega.data() + h * m * d;
      fpol_.mm(m, n, d, {View<T>{om, d, 1}}, {f.at, C}, f.u, C, false, nullptr);
      if (!s_.pair) {
        for (int64_t i = 0; i < m; ++i) {
          linear_attention::fused::sincos_scaled(f.u + i * C, n, pr_.scale, f.pt + i * C, f.pt + (m + i) * C, simd_);
        }
      } else {
        const T* om2 = pr_.omega2.data() + h * m * d;
        fpol_.mm(m, n, d, {View<T>{om2, d, 1}}, {f.at, C}, f.u2, C, false, nullptr);
        for (int64_t i = 0; i < m; ++i) {
          const int64_t at = i * C;
          linear_attention::fused::sincos_scaled(f.u + at, n, T(1), f.c1 + at, f.s1 + at, simd_);
          linear_attention::fused::sincos_scaled(f.u2 + at, n, T(1), f.c2 + at, f.s2 + at, simd_);
          ops_.scaled_sum(f.pt + at, f.c1 + at, f.c2 + at, pr_.scale, n);
          ops_.scaled_sum(f.pt + (m + i) * C, f.s1 + at, f.s2 + at, pr_.scale, n);
        }
      }
    }
    if (is_key && s_.key_weight) {
      // w = exp(|b|^2 / 2 - c): the key factor of exp(q.k / sqrt d) that survives the average (item 1, scale).
      ops_.add_scalar(f.w, -pr_.offset[static_cast<size_t>(h)], n);
      linear_attention::fused::exp_rows(f.w, n, f.w, simd_);
      for (int64_t r = 0; r < s_.F; ++r) ops_.mul(f.rt_buf + r * C, f.pt + r * C, f.w, n);
      f.rt = f.rt_buf;
    } else {
      std::fill(f.w, f.w + n, T(1));
      f.rt = f.pt;
    }
  }

  // features() for elu + 1, which needs no a rows (no frequencies to differentiate): the rows are read transposed,
  // x^T [d x n], summing |x|^2 on the way, then a^T = x^T g and phi^T are one pass over the tile vectorised over
  // tokens (two passes where the row form takes six: load, dots, scaling, transpose, exp, select). Same values as
  // the row form but |x|^2, summed over d in another order.
  void elu_features(Feat<T>& f, bool is_key, int64_t t0, int64_t h, int64_t n) const {
    const int64_t d = s_.d, C = s_.C;
    const In* src = is_key ? io_.k + t0 * io_.sk0 + h * io_.sk1 : io_.q + t0 * io_.sq0 + h * io_.sq1;
    T* ss = f.w;
    ops_.load_transposed(src, is_key ? io_.sk0 : io_.sq0, n, d, f.at, C, ss);
    for (int64_t t = 0; t < n; ++t) f.g[t] = conditioning_gain(ss[t]);
    // elu(a) + 1 = a + 1 (a > 0), exp(a) (a <= 0).
    for (int64_t j = 0; j < d; ++j) ops_.elu_map(f.at + j * C, f.pt + j * C, f.g, n);
    std::fill(f.w, f.w + n, T(1));  // elu has no key weight (prepare refuses one)
    f.rt = f.pt;
  }

  // g of a = g x from |x|^2 (docs/flexformer.md item 1).
  T conditioning_gain(T ss) const {
    if (s_.norm == InputNorm::kL2) return T(1) / std::sqrt(ss + T(kInputNormEps));
    if (s_.norm == InputNorm::kRms) return pr_.c0 / std::sqrt(ss / static_cast<T>(s_.d) + T(kInputNormEps));
    return pr_.c0;
  }

  // The chunk's keys and values into a state (or a range's sum): S += R^T V, z += R^T 1, S0 += alpha V^T w, ...
  void add_keys(T* st, int64_t h, int64_t n, const typename P::A& a_rt, const typename P::B& b_v) const {
    const int64_t d = s_.d, C = s_.C;
    pol_.mm(s_.F, d, n, a_rt, b_v, st, d, true, t_.ctmp);
    T* z = st + s_.z_at();
    for (int64_t r = 0; r < s_.F; ++r) z[r] += ops_.sum(t_.k.rt + r * C, n);
    if (s_.shift) {
      const T alpha = pr_.alpha[static_cast<size_t>(h)];
      T* s0 = st + s_.s0_at();
      for (int64_t t = 0; t < n; ++t) ops_.axpy(s0, t_.vr + t * d, alpha * t_.k.w[t], d);
      st[s_.z0_at()] += alpha * ops_.sum(t_.k.w, n);
    }
  }

  // Forward of one chunk from the state before it; leaves the state after it.
  void forward(int64_t t0, int64_t h, int64_t n) {
    const int64_t d = s_.d, C = s_.C, F = s_.F;
    Tiles<P>& t = t_;
    prefetch_next(Fetches::kQ);
    features(t.q, false, t0, h, n);
    prefetch_next(Fetches::kK);
    features(t.k, true, t0, h, n);
    prefetch_next(Fetches::kV);
    load(io_.v, io_.sv0, io_.sv1, t0, h, n, t.vr);
    prefetch_next(Fetches::kOut);
    const T* S = t.state;
    const T* z = t.state + s_.z_at();
    const T alpha = s_.shift ? pr_.alpha[static_cast<size_t>(h)] : T(0);
    // Sc = mask(P R^T + alpha^2 w^T), den = Sc 1.
    const auto a_p = pol_.pack_a(View<T>{t.q.pt, 1, C}, n, F, t.pack[0]);
    const auto b_rt = pol_.pack_b(t.k.rt, C, F, n, t.pack[1]);
    pol_.mm(n, n, F, a_p, b_rt, t.sc, C, false, t.ctmp);
    mask_scores(t.sc, n, alpha * alpha, t.k.w, t.den);
    // O = Sc V + P S (+ alpha S0), den += P z (+ alpha z0).
    const auto a_sc = pol_.pack_a(View<T>{t.sc, C, 1}, n, n, t.pack[2]);
    const auto b_v = pol_.pack_b(t.vr, d, n, d, t.pack[3]);
    pol_.mm(n, d, n, a_sc, b_v, t.o, d, false, t.ctmp);
    const auto b_s = pol_.pack_b(S, d, F, d, t.pack[4]);
    pol_.mm(n, d, F, a_p, b_s, t.o, d, true, t.ctmp);
    if (s_.has_den) {
      for (int64_t r = 0; r < F; ++r) ops_.axpy(t.den, t.q.pt + r * C, z[r], n);
    }
    if (s_.shift) {
      const T* s0 = t.state + s_.s0_at();
      ops_.add_scalar(t.den, alpha * t.state[s_.z0_at()], n);
      for (int64_t i = 0; i < n; ++i) ops_.axpy(t.o + i * d, s0, alpha, d);
    }
    const auto a_rt = pol_.pack_a(View<T>{t.k.rt, C, 1}, F, n, t.pack[5]);
    add_keys(t.state, h, n, a_rt, b_v);
    store_out(t0, h, n);
    prefetch_next(~0u);
  }

  // The range's state sum (the state pass of a split sequence): its keys and values only.
  void sum_keys(int64_t t0, int64_t h, int64_t n, T* st) {
    const int64_t d = s_.d, C = s_.C;
    prefetch_next(Fetches::kK);
    features(t_.k, true, t0, h, n);
    prefetch_next(Fetches::kV);
    load(io_.v, io_.sv0, io_.sv1, t0, h, n, t_.vr);
    const auto a_rt = pol_.pack_a(View<T>{t_.k.rt, C, 1}, s_.F, n, t_.pack[0]);
    const auto b_v = pol_.pack_b(t_.vr, d, n, d, t_.pack[1]);
    add_keys(st, h, n, a_rt, b_v);
    prefetch_next(~0u);
  }

  // The range's sum of the state gradient (the reverse state pass): its queries and output gradients only.
  void sum_queries(int64_t t0, int64_t h, int64_t n, T* dst) {
    const int64_t d = s_.d, C = s_.C;
    prefetch_next(Fetches::kQ);
    features(t_.q, false, t0, h, n);
    prefetch_next(Fetches::kGrads);
    output_grads(t0, h, n);
    const auto a_pt = pol_.pack_a(View<T>{t_.q.pt, C, 1}, s_.F, n, t_.pack[0]);
    const auto b_dn = pol_.pack_b(t_.dn, d, n, d, t_.pack[1]);
    add_queries(dst, h, n, a_pt, b_dn);
    prefetch_next(~0u);
  }

  // dS += P^T dn, dz += P^T dden, dS0 += alpha dn^T 1, dz0 += alpha dden^T 1.
  void add_queries(T* dst, int64_t h, int64_t n, const typename P::A& a_pt, const typename P::B& b_dn) const {
    const int64_t d = s_.d, C = s_.C;
    pol_.mm(s_.F, d, n, a_pt, b_dn, dst, d, true, t_.ctmp);
    const T alpha = s_.shift ? pr_.alpha[static_cast<size_t>(h)] : T(0);
    if (s_.has_den) {
      T* dz = dst + s_.z_at();
      for (int64_t r = 0; r < s_.F; ++r) dz[r] += ops_.dot(t_.q.pt + r * C, t_.dden, n);
    }
    if (s_.shift) {
      T* ds0 = dst + s_.s0_at();
      for (int64_t i = 0; i < n; ++i) ops_.axpy(ds0, t_.dn + i * d, alpha, d);
      if (s_.has_den) dst[s_.z0_at()] += alpha * ops_.sum(t_.dden, n);
    }
  }

  // Sweep 1 on one chunk: dq and the queries' parameter gradients from the state before the chunk; then the
  // state moves past it.
  void backward_queries(int64_t t0, int64_t h, int64_t n, T* grad) {
    const int64_t d = s_.d, C = s_.C, F = s_.F;
    Tiles<P>& t = t_;
    prefetch_next(Fetches::kQ);
    features(t.q, false, t0, h, n);
    prefetch_next(Fetches::kK);
    features(t.k, true, t0, h, n);
    prefetch_next(Fetches::kV);
    load(io_.v, io_.sv0, io_.sv1, t0, h, n, t.vr);
    prefetch_next(Fetches::kGrads);
    output_grads(t0, h, n);
    prefetch_next(Fetches::kDq);
    const T* S = t.state;
    const T* z = t.state + s_.z_at();
    const T alpha = s_.shift ? pr_.alpha[static_cast<size_t>(h)] : T(0);
    // dSc^T[s][i] = v_s . dn_i + dden_i for s <= i.
    const auto a_v = pol_.pack_a(View<T>{t.vr, d, 1}, n, d, t.pack[0]);
    const auto b_dnt = pol_.pack_b(t.dnt, C, d, n, t.pack[1]);
    pol_.mm(n, n, d, a_v, b_dnt, t.dsc, C, false, t.ctmp);
    for (int64_t r = 0; r < n; ++r) {
      T* row = t.dsc + r * C;
      std::fill(row, row + r, T(0));
      if (s_.has_den) ops_.axpy(row + r, t.dden + r, T(1), n - r);
    }
    // dP^T = R^T dSc^T + S dn^T + z dden^T.
    const auto a_rt = pol_.pack_a(View<T>{t.k.rt, C, 1}, F, n, t.pack[2]);
    const auto b_dsct = pol_.pack_b(t.dsc, C, n, n, t.pack[3]);
    pol_.mm(F, n, n, a_rt, b_dsct, t.dpt, C, false, t.ctmp);
    const auto a_s = pol_.pack_a(View<T>{S, d, 1}, F, d, t.pack[4]);
    pol_.mm(F, n, d, a_s, b_dnt, t.dpt, C, true, t.ctmp);
    if (s_.has_den) {
      for (int64_t r = 0; r < F; ++r) ops_.axpy(t.dpt + r * C, t.dden, z[r], n);
    }
    if (s_.shift) {
      // phi_q's alpha row: alpha sum_{s<=i} w_s dSc^T[s][i] + S0 . dn_i + z0 dden_i, summed over the chunk. The
      // first term is dn_i . (sum_{s<=i} w_s v_s) + dden_i sum_{s<=i} w_s: prefix sums in the accumulator
      // precision, not read from the (possibly bf16-product) dSc tile, because alpha's gradient is a small
      // difference of large sums.
      const T* s0 = t.state + s_.s0_at();
      const T z0 = t.state[s_.z0_at()];
      T* run = prefix_.data();
      std::fill(run, run + d, T(0));
      T w_sum = 0, sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        ops_.axpy(run, t.vr + i * d, t.k.w[i], d);
        w_sum += t.k.w[i];
        const T dd = s_.has_den ? t.dden[i] : T(0);
        sum += alpha * (ops_.dot(run, t.dn + i * d, d) + dd * w_sum) + ops_.dot(s0, t.dn + i * d, d) + z0 * dd;
      }
      grad[s_.dalpha_at()] += sum;
    }
    feature_backward(t.q, t.dpt, nullptr, t0, h, n, grad, io_.dq);
    const auto b_v = pol_.pack_b(t.vr, d, n, d, t.pack[5]);
    add_keys(t.state, h, n, a_rt, b_v);
    prefetch_next(~0u);
  }

  // Sweep 2 on one chunk (in reverse): dk, dv and the keys' parameter gradients from the gradient of the state
  // after the chunk (dstate); then dstate moves before it.
  void backward_keys(int64_t t0, int64_t h, int64_t n, T* grad) {
    const int64_t d = s_.d, C = s_.C, F = s_.F;
    Tiles<P>& t = t_;
    prefetch_next(Fetches::kQ);
    features(t.q, false, t0, h, n);
    prefetch_next(Fetches::kK);
    features(t.k, true, t0, h, n);
    prefetch_next(Fetches::kV);
    load(io_.v, io_.sv0, io_.sv1, t0, h, n, t.vr);
    ops_.transpose(t.vr, d, n, d, t.vt, C);
    prefetch_next(Fetches::kGrads | Fetches::kDout);
    output_grads(t0, h, n, /*reuse=*/true);
    prefetch_next(Fetches::kDv);
    const T* dS = t.dstate;
    const T* dz = t.dstate + s_.z_at();
    const T* ds0 = t.dstate + s_.s0_at();
    const T dz0 = t.dstate[s_.z0_at()];
    const T alpha = s_.shift ? pr_.alpha[static_cast<size_t>(h)] : T(0);
    // dSc[i][s] = dn_i . v_s + dden_i for s <= i; Sc as in the forward.
    const auto a_dn = pol_.pack_a(View<T>{t.dn, d, 1}, n, d, t.pack[0]);
    const auto b_vt = pol_.pack_b(t.vt, C, d, n, t.pack[1]);
    pol_.mm(n, n, d, a_dn, b_vt, t.dsc, C, false, t.ctmp);
    for (int64_t i = 0; i < n; ++i) {
      T* row = t.dsc + i * C;
      if (s_.has_den) ops_.add_scalar(row, t.dden[i], i + 1);
      std::fill(row + i + 1, row + n, T(0));
    }
    const auto a_p = pol_.pack_a(View<T>{t.q.pt, 1, C}, n, F, t.pack[2]);
    const auto b_rt = pol_.pack_b(t.k.rt, C, F, n, t.pack[3]);
    pol_.mm(n, n, F, a_p, b_rt, t.sc, C, false, t.ctmp);
    mask_scores(t.sc, n, alpha * alpha, t.k.w, nullptr);
    // dR^T = P^T dSc + dS V^T + dz 1^T.
    const auto a_pt = pol_.pack_a(View<T>{t.q.pt, C, 1}, F, n, t.pack[4]);
    const auto b_dsc = pol_.pack_b(t.dsc, C, n, n, t.pack[5]);
    pol_.mm(F, n, n, a_pt, b_dsc, t.dpt, C, false, t.ctmp);
    const auto a_ds = pol_.pack_a(View<T>{dS, d, 1}, F, d, t.pack[6]);
    pol_.mm(F, n, d, a_ds, b_vt, t.dpt, C, true, t.ctmp);
    if (s_.has_den) {
      for (int64_t r = 0; r < F; ++r) ops_.add_scalar(t.dpt + r * C, dz[r], n);
    }
    if (s_.shift) {
      // phi_k's alpha row (alpha w_s): alpha sum_{i>=s} dSc[i][s] + dS0 . v_s + dz0, the first term as
      // v_s . (sum_{i>=s} dn_i) + sum_{i>=s} dden_i: suffix sums, for the reason given in backward_queries.
      T* run = prefix_.data();
      std::fill(run, run + d, T(0));
      T dd_sum = 0;
      for (int64_t r = n; r-- > 0;) {
        ops_.axpy(run, t.dn + r * d, T(1), d);
        if (s_.has_den) dd_sum += t.dden[r];
        t.col[r] = alpha * (ops_.dot(run, t.vr + r * d, d) + dd_sum) + ops_.dot(ds0, t.vr + r * d, d) +
                   (s_.has_den ? dz0 : T(0));
      }
    }
    // dV = Sc^T dn + R dS + alpha w dS0^T.
    const auto a_sct = pol_.pack_a(View<T>{t.sc, 1, C}, n, n, t.pack[0]);
    const auto b_dn = pol_.pack_b(t.dn, d, n, d, t.pack[7]);
    pol_.mm(n, d, n, a_sct, b_dn, t.dvr, d, false, t.ctmp);
    const auto a_r = pol_.pack_a(View<T>{t.k.rt, 1, C}, n, F, t.pack[1]);
    const auto b_ds = pol_.pack_b(dS, d, F, d, t.pack[3]);
    pol_.mm(n, d, F, a_r, b_ds, t.dvr, d, true, t.ctmp);
    if (s_.shift) {
      for (int64_t r = 0; r < n; ++r) ops_.axpy(t.dvr + r * d, ds0, alpha * t.k.w[r], d);
    }
    ops_.store_rows(t.dvr, d, n, d, static_cast<const T*>(nullptr), io_.dv + (t0 * s_.heads + h) * d, s_.heads * d);
    add_queries(t.dstate, h, n, a_pt, b_dn);
    prefetch_next(Fetches::kDk);
    // Through the key weight w (phi_k = w [alpha; phi]): dphi = w dR, dw = dR . phi + alpha dalpha_row,
    // dw / db = w b.
    if (s_.shift) grad[s_.dalpha_at()] += ops_.dot(t.k.w, t.col, n);
    const T* extra = nullptr;
    if (s_.key_weight) {
      for (int64_t r = 0; r < n; ++r) t.ex[r] = s_.shift ? alpha * t.col[r] : T(0);
      for (int64_t f = 0; f < F; ++f) {
        ops_.fma_into(t.ex, t.dpt + f * C, t.k.pt + f * C, n);
        ops_.mul(t.dpt + f * C, t.dpt + f * C, t.k.w, n);
      }
      ops_.mul(t.ex, t.ex, t.k.w, n);
      extra = t.ex;
    }
    feature_backward(t.k, t.dpt, extra, t0, h, n, grad, io_.dk);
    prefetch_next(~0u);
  }

  Tiles<P>& tiles() { return t_; }
  const std::vector<int64_t>* bounds() const { return io_.bounds; }

 private:
  // Lower triangle of the scores plus the shift feature's alpha^2 w_s; row sums into den (if not null).
  void mask_scores(T* sc, int64_t n, T a2, const T* w, T* den) const {
    for (int64_t i = 0; i < n; ++i) {
      T* row = sc + i * s_.C;
      if (a2 != T(0)) ops_.axpy(row, w, a2, i + 1);
      std::fill(row + i + 1, row + n, T(0));
      if (den) den[i] = ops_.sum(row, i + 1);
    }
  }

  // The factor y = O * output_scale(stat): 1 / (den + eps) (shift), 1 / max(den, eps) (clamp), stat itself (none,
  // where stat is the RMS factor).
  T output_scale(T st) const {
    switch (s_.normalizer) {
      case Normalizer::kShift: return T(1) / (st + T(kShiftEps));
      case Normalizer::kClamp: return T(1) / std::max(st, T(kClampEps));
      case Normalizer::kNone: break;
    }
    return st;
  }

  // y = O / (den + eps) | O / max(den, eps) | O rsqrt(mean O^2 + eps), and stat (den or the RMS factor).
  void store_out(int64_t t0, int64_t h, int64_t n) const {
    const int64_t d = s_.d;
    T* inv = t_.col;
    for (int64_t i = 0; i < n; ++i) {
      const T st = s_.has_den ? t_.den[i]
                              : T(1) / std::sqrt(ops_.dot(t_.o + i * d, t_.o + i * d, d) / static_cast<T>(d) +
                                                 T(kOutNormEps));
      inv[i] = output_scale(st);
      io_.stat[(t0 + i) * s_.heads + h] = st;
    }
    In* out = io_.out + (t0 * s_.heads + h) * d;
    if (!io_.out_lo) return ops_.store_rows(t_.o, d, n, d, inv, out, s_.heads * d);
    // bf16: y in fp32 (dy as scratch), its rounding, then the residual y - bf16(y) (yr as scratch).
    ops_.store_rows(t_.o, d, n, d, inv, t_.dy, d);
    ops_.store_rows(t_.dy, d, n, d, static_cast<const T*>(nullptr), out, s_.heads * d);
    ops_.load_rows(out, s_.heads * d, n, d, t_.yr, d);
    for (int64_t i = 0; i < n; ++i) ops_.axpy(t_.dy + i * d, t_.yr + i * d, T(-1), d);
    ops_.store_rows(t_.dy, d, n, d, static_cast<const T*>(nullptr), io_.out_lo + (t0 * s_.heads + h) * d,
                    s_.heads * d);
  }

  // dn (the gradient of the numerator), dden (of the denominator) and dn^T from dy, the saved y and stat. With
  // `reuse` (the backward's second sweep) and a denominator, dden is read back from io_.dden, where the first
  // sweep left it, and y is not read: dn = dy / den needs only dy and stat (the same bits as computing it again).
  void output_grads(int64_t t0, int64_t h, int64_t n, bool reuse = false) const {
    const int64_t d = s_.d;
    const bool read_dden = reuse && s_.has_den;
    load(io_.dout, io_.sg0, io_.sg1, t0, h, n, t_.dy);
    if (!read_dden) {
      load(io_.y, io_.sy0, io_.sy1, t0, h, n, t_.yr);
      if (io_.y_lo) {
        ops_.load_rows(io_.y_lo + (t0 * s_.heads + h) * d, s_.heads * d, n, d, t_.dn, d);
        for (int64_t i = 0; i < n; ++i) ops_.axpy(t_.yr + i * d, t_.dn + i * d, T(1), d);
      }
    }
    T* scale = t_.col;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = (t0 + i) * s_.heads + h;
      const T st = io_.stat_in[at];
      scale[i] = output_scale(st);
      if (read_dden) {
        t_.dden[i] = io_.dden[at];
        continue;
      }
      const T dot = ops_.dot(t_.dy + i * d, t_.yr + i * d, d);
      switch (s_.normalizer) {
        case Normalizer::kShift:
          t_.dden[i] = -dot * scale[i];
          break;
        case Normalizer::kClamp:
          // No gradient reaches a clamped denominator (as torch's clamp_min: it passes where den >= eps).
          t_.dden[i] = st >= T(kClampEps) ? -dot * scale[i] : T(0);
          break;
        case Normalizer::kNone:
          // y = O r, r = (mean O^2 + eps)^-1/2: dO = r (dy - y mean(dy y)).
          t_.dden[i] = 0;
          ops_.axpy(t_.dy + i * d, t_.yr + i * d, -dot / static_cast<T>(d), d);
          break;
      }
      if (s_.has_den) io_.dden[at] = t_.dden[i];
    }
    ops_.store_rows(t_.dy, d, n, d, scale, t_.dn, d);
    ops_.transpose(t_.dn, d, n, d, t_.dnt, s_.C);
  }

  // From dphi^T [F x n] (of the unweighted features) to dx (written to dx_out's rows) and the frequencies'
  // gradients; extra[t] (keys with a weight) adds extra[t] a_t to da_t.
  void feature_backward(Feat<T>& f, const T* dphi, const T* extra, int64_t t0, int64_t h, int64_t n, T* grad,
                        In* dx_out) const {
    const int64_t d = s_.d, C = s_.C, m = s_.m;
    T* da = t_.da;
    if (s_.trig) {
      for (int64_t i = 0; i < m; ++i) {
        const int64_t at = i * C;
        const T* gc = dphi + at;
        const T* gs = dphi + (m + i) * C;
        if (!s_.pair) {
          // phi = s [cos u; sin u]: du = phi_cos dphi_sin - phi_sin dphi_cos.
          ops_.cross(t_.du + at, f.pt + at, gs, f.pt + (m + i) * C, gc, T(1), n);
        } else {
          ops_.cross(t_.du + at, f.c1 + at, gs, f.s1 + at, gc, pr_.scale, n);
          ops_.cross(t_.du2 + at, f.c2 + at, gs, f.s2 + at, gc, pr_.scale, n);
        }
      }
      // da^T = Omega^T du^T; dOmega += du^T a.
      const T* om = pr_.omega.data() + h * m * d;
      fpol_.mm(d, n, m, {View<T>{om, 1, d}}, {t_.du, C}, da, C, false, nullptr);
      if (s_.pair) {
        const T* om2 = pr_.omega2.data() + h * m * d;
        fpol_.mm(d, n, m, {View<T>{om2, 1, d}}, {t_.du2, C}, da, C, true, nullptr);
      }
      if (s_.omega_grad) {
        fpol_.mm(m, d, n, {View<T>{t_.du, C, 1}}, {f.a, d}, grad, d, true, nullptr);
        if (s_.pair) fpol_.mm(m, d, n, {View<T>{t_.du2, C, 1}}, {f.a, d}, grad + s_.domega2_at(), d, true, nullptr);
      }
    }
    // Conditioning: a = g x, dx = g (da - kappa a (a . da)), per token (column).
    T* dot = t_.col;
    std::fill(dot, dot + n, T(0));
    if (!s_.trig) {  // elu (never a key weight, so no extra): da and a . da in one pass
      for (int64_t j = 0; j < d; ++j) {
        ops_.elu_grad_dot(da + j * C, dphi + j * C, f.at + j * C, f.pt + j * C, dot, n);
      }
    } else {
      if (extra) {
        for (int64_t j = 0; j < d; ++j) ops_.fma_into(da + j * C, extra, f.at + j * C, n);
      }
      for (int64_t j = 0; j < d; ++j) ops_.fma_into(dot, f.at + j * C, da + j * C, n);
    }
    for (int64_t j = 0; j < d; ++j) ops_.cond_backward(da + j * C, da + j * C, f.at + j * C, f.g, dot, pr_.kappa, n);
    ops_.store_transposed(da, C, n, d, dx_out + (t0 * s_.heads + h) * d, s_.heads * d);
  }

  const Shape& s_;
  const Params<T>& pr_;
  const P& pol_;
  RowPolicy<T> fpol_;  // the feature products stay in the accumulator precision on every path
  linear_attention::fused::Rows<T> ops_;
  bool simd_;
  const Io<In, T>& io_;
  Tiles<P>& t_;
  std::vector<T> prefix_;  // [d]: the shift feature's running sums (allocated once per thread)
  int64_t pf_t0_ = 0, pf_h_ = 0, pf_n_ = 0;  // the planned prefetch (plan_prefetch)
  unsigned pf_what_ = 0;
};

// ---- the passes ----------------------------------------------------------------------------------------------

// Tokens [t0, t0 + n) of chunk c of a unit's sequence.
struct ChunkSpan {
  int64_t t0, n;
};
ChunkSpan chunk_of(const std::vector<int64_t>& bounds, const Unit& u, int64_t c, int64_t chunk) {
  const int64_t a = bounds[u.seq] + c * chunk;
  return {a, std::min(chunk, bounds[u.seq + 1] - a)};
}

// Plans the prefetch of chunk c of unit u (Chunks::plan_prefetch): `what` of its rows arrive while the chunk
// before it computes.
template <class Ch>
void prefetch_chunk(Ch& ch, const Unit& u, int64_t c, int64_t chunk, unsigned what) {
  const ChunkSpan next = chunk_of(*ch.bounds(), u, c, chunk);
  ch.plan_prefetch(next.t0, u.head, next.n, what);
}

template <class P>
void amx_enter(const P& pol) {
  if constexpr (std::is_same_v<P, Bf16Policy>) {
    if (pol.amx) tiles::amx_begin();
  }
}
template <class P>
void amx_leave(const P& pol) {
  if constexpr (std::is_same_v<P, Bf16Policy>) {
    if (pol.amx) tiles::amx_end();
  }
}

// Runs body(chunks, unit index) for every unit index of `list_of(thread)` on each thread with its tiles.
template <class P, class In, class T, class List, class Body>
void run_threads(const Shape& s, const Params<T>& pr, const P& pol, bool simd, const Io<In, T>& io, int64_t threads,
                 List list_of, Body body) {
  parallel_with_arenas(threads, tile_bytes<P>(s), [&](int64_t thread, Arena& arena) {
    const std::vector<int64_t>& list = list_of(thread);
    if (list.empty()) return;
    Tiles<P> t = take_tiles<P>(s, arena);
    Chunks<P, In> chunks(s, pr, pol, simd, io, t);
    amx_enter(pol);
    for (int64_t u : list) body(chunks, thread, u);
    amx_leave(pol);
  });
}

// A thread's units in bundles: consecutive units of its list over the same chunks of the same sequence (so of
// different heads) form one bundle, which the passes run in lockstep, chunk by chunk, every head of the bundle
// on a chunk before the next chunk. The rows of one head are d elements every H d of a [T, H, d] tensor: one head
// alone reads 1/H of each row's cache lines and leaves the rest for a later pass, while the heads of a bundle
// read a chunk's rows together (at 16K+ tokens the tensors no longer fit in the last-level cache). Each head
// keeps its own state; its chunks run in the same order as alone, so the results are the same bits.
std::vector<std::vector<int64_t>> bundles_of(const UnitPlan& plan, const std::vector<int64_t>& list) {
  std::vector<std::vector<int64_t>> out;
  for (int64_t ui : list) {
    const Unit& u = plan.units[ui];
    if (!out.empty()) {
      const Unit& b = plan.units[out.back().front()];
      if (b.seq == u.seq && b.c0 == u.c0 && b.c1 == u.c1) {
        out.back().push_back(ui);
        continue;
      }
    }
    out.push_back({ui});
  }
  return out;
}

// Runs body(chunks, thread, bundle) for each bundle of every thread's list (bundles_of), with its tiles.
template <class P, class In, class T, class Body>
void run_bundles(const Shape& s, const Params<T>& pr, const P& pol, bool simd, const Io<In, T>& io, int64_t threads,
                 const UnitPlan& plan, Body body) {
  std::vector<std::vector<std::vector<int64_t>>> bundles(plan.of_thread.size());
  std::vector<std::vector<int64_t>> indices(plan.of_thread.size());  // each thread's bundles, by index
  for (size_t t = 0; t < plan.of_thread.size(); ++t) {
    bundles[t] = bundles_of(plan, plan.of_thread[t]);
    indices[t].resize(bundles[t].size());
    std::iota(indices[t].begin(), indices[t].end(), int64_t{0});
  }
  run_threads<P>(s, pr, pol, simd, io, threads,
                 [&](int64_t t) -> const std::vector<int64_t>& { return indices[static_cast<size_t>(t)]; },
                 [&](Chunks<P, In>& ch, int64_t thread, int64_t i) {
                   body(ch, thread, bundles[static_cast<size_t>(thread)][static_cast<size_t>(i)]);
                 });
}

// Runs body(j, unit, span) for bundle b's units j on every chunk of their range, chunk by chunk (the last chunk
// first when `reverse`), every unit of the bundle on a chunk before the next chunk; before each, the prefetch of
// the next (chunk, unit)'s `what` rows is planned.
template <class Ch, class Body>
void lockstep(Ch& ch, const UnitPlan& plan, const std::vector<int64_t>& b, int64_t chunk, bool reverse, unsigned what,
              Body body) {
  const Unit& first = plan.units[b.front()];
  const int64_t B = static_cast<int64_t>(b.size()), chunks = first.c1 - first.c0;
  for (int64_t i = 0; i < chunks; ++i) {
    const int64_t c = reverse ? first.c1 - 1 - i : first.c0 + i;
    for (int64_t j = 0; j < B; ++j) {
      const Unit& u = plan.units[b[j]];
      if (j + 1 < B) {
        prefetch_chunk(ch, plan.units[b[j + 1]], c, chunk, what);
      } else if (i + 1 < chunks) {
        prefetch_chunk(ch, first, reverse ? c - 1 : c + 1, chunk, what);
      }
      body(j, u, chunk_of(*ch.bounds(), u, c, chunk));
    }
  }
}

// The state unit u starts from: its range's prefix (a split sequence), else the sequence's initial state, else 0.
template <class T>
void start_state(const Shape& s, const Unit& u, const T* start, const T* initial, T* state) {
  const int64_t L = s.state_len(), sh = u.seq * s.heads + u.head;
  if (u.slot >= 0) {
    std::copy(start + u.slot * L, start + (u.slot + 1) * L, state);
  } else if (initial) {
    std::copy(initial + sh * L, initial + (sh + 1) * L, state);
  } else {
    std::fill(state, state + L, T(0));
  }
}

// For each split (sequence, head), the states its ranges start from: the initial state plus the sums of the ranges
// before (the state pass). sums and starts are [slots x L].
template <class T>
void prefix_states(const Shape& s, const UnitPlan& plan, const T* initial, const T* sums, T* starts) {
  const int64_t L = s.state_len();
  for (const auto& members : plan.groups) {
    const Unit& first = plan.units[members.front()];
    T* st = starts + first.slot * L;
    if (initial) {
      std::copy(initial + (first.seq * s.heads + first.head) * L, initial + (first.seq * s.heads + first.head + 1) * L,
                st);
    } else {
      std::fill(st, st + L, T(0));
    }
    for (size_t p = 1; p < members.size(); ++p) {
      const Unit& prev = plan.units[members[p - 1]];
      T* next = starts + plan.units[members[p]].slot * L;
      for (int64_t e = 0; e < L; ++e) next[e] = starts[prev.slot * L + e] + sums[prev.slot * L + e];
    }
  }
}

// The state gradients each range of a split (sequence, head) ends with: the sums of the ranges after it.
template <class T>
void suffix_states(const Shape& s, const UnitPlan& plan, const T* sums, T* ends) {
  const int64_t L = s.state_len();
  for (const auto& members : plan.groups) {
    T* last = ends + plan.units[members.back()].slot * L;
    std::fill(last, last + L, T(0));
    for (size_t p = members.size() - 1; p-- > 0;) {
      const Unit& after = plan.units[members[p + 1]];
      T* here = ends + plan.units[members[p]].slot * L;
      for (int64_t e = 0; e < L; ++e) here[e] = ends[after.slot * L + e] + sums[after.slot * L + e];
    }
  }
}

template <class T>
torch::ScalarType dtype_of() {
  return std::is_same_v<T, double> ? torch::kDouble : torch::kFloat;
}

// Units of the state passes: per thread, its split units (all but the last range: key sums; all but the first:
// query sums), in the thread's order.
std::vector<std::vector<int64_t>> split_lists(const UnitPlan& plan, bool keys) {
  std::vector<std::vector<int64_t>> lists(plan.of_thread.size());
  for (size_t t = 0; t < plan.of_thread.size(); ++t) {
    for (int64_t u : plan.of_thread[t]) {
      const Unit& x = plan.units[u];
      if (x.pieces > 1 && (keys ? x.piece + 1 < x.pieces : x.piece > 0)) lists[t].push_back(u);
    }
  }
  return lists;
}

template <class P, class In>
void forward_pass(const Shape& s, const Params<typename P::Acc>& pr, const P& pol, bool simd,
                  const Io<In, typename P::Acc>& io, const typename P::Acc* initial, typename P::Acc* finals) {
  using T = typename P::Acc;
  const int64_t threads = at::get_num_threads(), L = s.state_len();
  const UnitPlan plan = plan_units(*io.bounds, s.heads, s.C, threads);
  torch::Tensor sums, starts;
  if (plan.slots > 0) {
    sums = torch::zeros({plan.slots * L}, dtype_of<T>());
    starts = torch::empty({plan.slots * L}, dtype_of<T>());
    const auto lists = split_lists(plan, /*keys=*/true);
    T* sum = sums.data_ptr<T>();
    run_threads<P>(s, pr, pol, simd, io, threads, [&](int64_t t) -> const std::vector<int64_t>& { return lists[t]; },
                   [&](Chunks<P, In>& ch, int64_t, int64_t ui) {
                     const Unit& u = plan.units[ui];
                     for (int64_t c = u.c0; c < u.c1; ++c) {
                       const ChunkSpan span = chunk_of(*io.bounds, u, c, s.C);
                       if (c + 1 < u.c1) prefetch_chunk(ch, u, c + 1, s.C, Fetches::kK | Fetches::kV);
                       ch.sum_keys(span.t0, u.head, span.n, sum + u.slot * L);
                     }
                   });
    prefix_states(s, plan, initial, sum, starts.data_ptr<T>());
  }
  const T* start = plan.slots > 0 ? starts.data_ptr<T>() : nullptr;
  run_bundles<P, In>(s, pr, pol, simd, io, threads, plan,
                     [&](Chunks<P, In>& ch, int64_t, const std::vector<int64_t>& b) {
    const int64_t B = static_cast<int64_t>(b.size());
    std::vector<T> states(static_cast<size_t>(B * L));
    for (int64_t j = 0; j < B; ++j) start_state(s, plan.units[b[j]], start, initial, states.data() + j * L);
    constexpr unsigned kRows = Fetches::kQ | Fetches::kK | Fetches::kV | Fetches::kOut;
    lockstep(ch, plan, b, s.C, /*reverse=*/false, kRows, [&](int64_t j, const Unit& u, const ChunkSpan& span) {
      ch.tiles().state = states.data() + j * L;
      ch.forward(span.t0, u.head, span.n);
    });
    for (int64_t j = 0; j < B; ++j) {
      const Unit& u = plan.units[b[j]];
      const int64_t sh = u.seq * s.heads + u.head;
      if (finals && u.piece + 1 == u.pieces) {
        std::copy(states.data() + j * L, states.data() + (j + 1) * L, finals + sh * L);
      }
    }
  });
}

template <class P, class In>
void backward_pass(const Shape& s, const Params<typename P::Acc>& pr, const P& pol, bool simd,
                   const Io<In, typename P::Acc>& io, const typename P::Acc* initial, typename P::Acc* grads) {
  using T = typename P::Acc;
  const int64_t threads = at::get_num_threads(), L = s.state_len(), G = s.grad_len();
  const UnitPlan plan = plan_units(*io.bounds, s.heads, s.C, threads);
  torch::Tensor starts, ends;
  if (plan.slots > 0) {
    torch::Tensor key_sums = torch::zeros({plan.slots * L}, dtype_of<T>());
    torch::Tensor query_sums = torch::zeros({plan.slots * L}, dtype_of<T>());
    const auto key_lists = split_lists(plan, /*keys=*/true), query_lists = split_lists(plan, /*keys=*/false);
    T* ks = key_sums.data_ptr<T>();
    T* qs = query_sums.data_ptr<T>();
    run_threads<P>(s, pr, pol, simd, io, threads,
                   [&](int64_t t) -> const std::vector<int64_t>& { return key_lists[t]; },
                   [&](Chunks<P, In>& ch, int64_t, int64_t ui) {
                     const Unit& u = plan.units[ui];
                     for (int64_t c = u.c0; c < u.c1; ++c) {
                       const ChunkSpan span = chunk_of(*io.bounds, u, c, s.C);
                       if (c + 1 < u.c1) prefetch_chunk(ch, u, c + 1, s.C, Fetches::kK | Fetches::kV);
                       ch.sum_keys(span.t0, u.head, span.n, ks + u.slot * L);
                     }
                   });
    run_threads<P>(s, pr, pol, simd, io, threads,
                   [&](int64_t t) -> const std::vector<int64_t>& { return query_lists[t]; },
                   [&](Chunks<P, In>& ch, int64_t, int64_t ui) {
                     const Unit& u = plan.units[ui];
                     for (int64_t c = u.c0; c < u.c1; ++c) {
                       const ChunkSpan span = chunk_of(*io.bounds, u, c, s.C);
                       if (c + 1 < u.c1) prefetch_chunk(ch, u, c + 1, s.C, Fetches::kQ | Fetches::kGrads);
                       ch.sum_queries(span.t0, u.head, span.n, qs + u.slot * L);
                     }
                   });
    starts = torch::empty({plan.slots * L}, dtype_of<T>());
    ends = torch::empty({plan.slots * L}, dtype_of<T>());
    prefix_states(s, plan, initial, ks, starts.data_ptr<T>());
    suffix_states(s, plan, qs, ends.data_ptr<T>());
  }
  const T* start = plan.slots > 0 ? starts.data_ptr<T>() : nullptr;
  const T* end = plan.slots > 0 ? ends.data_ptr<T>() : nullptr;
  // Each thread sums its units' parameter gradients per head; the threads' sums are added in thread order.
  torch::Tensor partial = torch::zeros({threads * s.heads * G}, dtype_of<T>());
  T* part = partial.data_ptr<T>();
  run_bundles<P, In>(s, pr, pol, simd, io, threads, plan, [&](Chunks<P, In>& ch, int64_t thread,
                                                            const std::vector<int64_t>& b) {
    const int64_t B = static_cast<int64_t>(b.size());
    std::vector<T> states(static_cast<size_t>(2 * B * L));
    T* state_of = states.data();
    T* dstate_of = states.data() + B * L;
    for (int64_t j = 0; j < B; ++j) {
      const Unit& u = plan.units[b[j]];
      start_state(s, u, start, initial, state_of + j * L);
      T* dstate = dstate_of + j * L;
      if (u.slot >= 0) {
        std::copy(end + u.slot * L, end + (u.slot + 1) * L, dstate);
      } else {
        std::fill(dstate, dstate + L, T(0));
      }
    }
    auto grad_of = [&](const Unit& u) { return part + (thread * s.heads + u.head) * G; };
    constexpr unsigned kBoth = Fetches::kQ | Fetches::kK | Fetches::kV | Fetches::kGrads;
    // Sweep 1, chunks in order: dq and the queries' gradients.
    lockstep(ch, plan, b, s.C, /*reverse=*/false, kBoth | Fetches::kDq,
             [&](int64_t j, const Unit& u, const ChunkSpan& span) {
               ch.tiles().state = state_of + j * L;
               ch.backward_queries(span.t0, u.head, span.n, grad_of(u));
             });
    // Sweep 2, chunks in reverse: dk, dv and the keys' gradients (with a denominator, dy without y: output_grads).
    const unsigned grads2 = s.has_den ? Fetches::kDout : Fetches::kGrads;
    lockstep(ch, plan, b, s.C, /*reverse=*/true, (kBoth & ~Fetches::kGrads) | grads2 | Fetches::kDk | Fetches::kDv,
             [&](int64_t j, const Unit& u, const ChunkSpan& span) {
               ch.tiles().dstate = dstate_of + j * L;
               ch.backward_keys(span.t0, u.head, span.n, grad_of(u));
             });
  });
  for (int64_t t = 0; t < threads; ++t) {
    for (int64_t e = 0; e < s.heads * G; ++e) grads[e] += part[t * s.heads * G + e];
  }
}

// ---- checks and dispatch -------------------------------------------------------------------------------------

std::string shape_str(const torch::Tensor& t) {
  return t.defined() ? "[" + fmt::format("{}", fmt::join(t.sizes(), ", ")) + "]" : std::string("undefined");
}

std::vector<int64_t> host_bounds(const char* who, const torch::Tensor& cu, int64_t total) {
  if (!cu.defined() || cu.dim() != 1 || cu.numel() < 2) {
    throw std::invalid_argument(
        fmt::format("{}: cu_seqlens must be 1-D with at least 2 entries, got {}", who, shape_str(cu)));
  }
  const torch::Tensor c = cu.to(torch::kCPU, torch::kInt64).contiguous();
  std::vector<int64_t> b(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  bool ok = b.front() == 0 && b.back() == total;
  for (size_t i = 1; i < b.size(); ++i) ok = ok && b[i] >= b[i - 1];
  if (!ok) throw std::invalid_argument(fmt::format("{}: cu_seqlens must run non-decreasing from 0 to T = {}", who, total));
  return b;
}

void check_param(const char* who, const char* name, const torch::Tensor& t, std::vector<int64_t> want, bool needed) {
  if (!needed) {
    if (t.defined()) {
      throw std::invalid_argument(fmt::format("{}: map.{} is given but this feature map and normaliser use none", who,
                                              name));
    }
    return;
  }
  if (!t.defined() || t.sizes() != c10::IntArrayRef(want) ||
      (t.scalar_type() != torch::kFloat && t.scalar_type() != torch::kDouble)) {
    throw std::invalid_argument(fmt::format("{}: map.{} must be fp32 or fp64 [{}], got {}", who, name,
                                            fmt::join(want, ", "), shape_str(t)));
  }
}

struct Prepared {
  Shape shape;
  std::vector<int64_t> bounds;
  LinearAttentionPath path = LinearAttentionPath::kPortable;
};

Prepared prepare(const char* who, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                 const torch::Tensor& cu, const FusedFeatureMap& map, const FusedLinearAttentionOptions& options) {
  if (!q.defined() || !k.defined() || !v.defined() || q.dim() != 3 || k.sizes() != q.sizes() ||
      v.sizes() != q.sizes()) {
    throw std::invalid_argument(fmt::format("{}: q, k and v must all be [T, heads, head_dim], got {}, {}, {}", who,
                                            shape_str(q), shape_str(k), shape_str(v)));
  }
  const auto dtype = q.scalar_type();
  if ((dtype != torch::kFloat && dtype != torch::kDouble && dtype != torch::kBFloat16) ||
      k.scalar_type() != dtype || v.scalar_type() != dtype) {
    throw std::invalid_argument(fmt::format("{}: q, k and v must share one dtype among fp32, bf16 and fp64", who));
  }
  if (!q.device().is_cpu() || !k.device().is_cpu() || !v.device().is_cpu()) {
    throw std::invalid_argument(fmt::format("{}: the fused kernel runs on the CPU (q is on {})", who,
                                            q.device().str()));
  }
  if (q.size(1) < 1 || q.size(2) < 1) {
    throw std::invalid_argument(fmt::format("{}: heads and head_dim must be >= 1, got {}", who, shape_str(q)));
  }
  if (options.chunk_size < 1) {
    throw std::invalid_argument(fmt::format("{}: chunk_size must be >= 1, got {}", who, options.chunk_size));
  }
  Prepared p;
  p.bounds = host_bounds(who, cu, q.size(0));
  Shape& s = p.shape;
  s.heads = q.size(1);
  s.d = q.size(2);
  s.map = map.feature_map;
  s.norm = map.input_norm;
  s.normalizer = map.normalizer;
  s.trig = map.feature_map != FeatureMap::kElu;
  s.pair = map.feature_map == FeatureMap::kNonstationary;
  s.shift = map.normalizer == Normalizer::kShift;
  s.has_den = map.normalizer != Normalizer::kNone;
  s.key_weight = map.key_offset.defined();
  if (s.trig) {
    if (!map.omega.defined() || map.omega.dim() != 3) {
      throw std::invalid_argument(fmt::format("{}: map.omega must be [heads, m, head_dim] for a trig feature map, got "
                                              "{}", who, shape_str(map.omega)));
    }
    s.m = map.omega.size(1);
    if (s.m < 1) throw std::invalid_argument(fmt::format("{}: map.omega has no frequencies ({})", who, shape_str(map.omega)));
  }
  check_param(who, "omega", map.omega, {s.heads, s.m, s.d}, s.trig);
  check_param(who, "omega2", map.omega2, {s.heads, s.m, s.d}, s.pair);
  check_param(who, "alpha", map.alpha, {s.heads}, s.shift);
  if (s.key_weight) {
    if (!s.trig || map.input_norm != InputNorm::kScale) {
      throw std::invalid_argument(fmt::format("{}: map.key_offset (the key weight) needs input_norm scale and a trig "
                                              "feature map", who));
    }
    check_param(who, "key_offset", map.key_offset, {s.heads}, true);
  }
  s.F = s.trig ? 2 * s.m : s.d;
  int64_t longest = 1;
  for (size_t i = 0; i + 1 < p.bounds.size(); ++i) longest = std::max(longest, p.bounds[i + 1] - p.bounds[i]);
  s.C = std::min(options.chunk_size, longest);  // a chunk past every sequence would only be padding
  p.path = resolve_linear_attention_path(dtype, options.path);
  return p;
}

template <class T>
Params<T> params_of(const Shape& s, const FusedFeatureMap& map) {
  Params<T> pr;
  auto host = [](const torch::Tensor& t) {
    if (!t.defined()) return std::vector<T>{};
    const torch::Tensor c = t.detach().to(torch::kCPU, dtype_of<T>()).contiguous();
    return std::vector<T>(c.data_ptr<T>(), c.data_ptr<T>() + c.numel());
  };
  pr.omega = host(map.omega);
  pr.omega2 = host(map.omega2);
  pr.alpha = host(map.alpha);
  pr.offset = host(map.key_offset);
  const T d = static_cast<T>(s.d);
  pr.scale = s.trig ? T(1) / std::sqrt(static_cast<T>((s.pair ? 4 : 1) * s.m)) : T(1);
  pr.c0 = s.norm == InputNorm::kL2 ? T(1) : static_cast<T>(std::pow(static_cast<double>(d), -0.25));
  pr.kappa = s.norm == InputNorm::kL2 ? T(1) : s.norm == InputNorm::kRms ? T(1) / std::sqrt(d) : T(0);
  return pr;
}

// Calls fn(policy, simd, In{}) for the resolved path and q's dtype.
template <class Fn>
void with_path(torch::ScalarType dtype, LinearAttentionPath path, Fn fn) {
  const bool simd = path != LinearAttentionPath::kPortable;
  switch (dtype) {
    case torch::kDouble: return fn(RowPolicy<double>{false}, false, double{});
    case torch::kFloat: return fn(RowPolicy<float>{simd}, simd, float{});
    default:
      if (path == LinearAttentionPath::kAvx512Bf16 || path == LinearAttentionPath::kAmx) {
        Bf16Policy pol;
        pol.amx = path == LinearAttentionPath::kAmx;
        return fn(pol, true, c10::BFloat16{});
      }
      return fn(RowPolicy<float>{simd}, simd, c10::BFloat16{});
  }
}

// Internal state layout [n_seq, H, L] from the reference forms' LinearAttentionState (shift feature first) and back.
torch::Tensor internal_state(const Shape& s, const LinearAttentionState& st, int64_t n_seq, torch::ScalarType acc) {
  const int64_t fp = s.F + (s.shift ? 1 : 0);
  if (!st.s.defined() || !st.z.defined() || st.s.sizes() != c10::IntArrayRef({n_seq, s.heads, fp, s.d}) ||
      st.z.sizes() != c10::IntArrayRef({n_seq, s.heads, fp})) {
    throw std::invalid_argument(fmt::format("fused_linear_attention: initial state must be s [{}, {}, {}, {}] and z "
                                            "[{}, {}, {}], got s {} and z {}",
                                            n_seq, s.heads, fp, s.d, n_seq, s.heads, fp, shape_str(st.s),
                                            shape_str(st.z)));
  }
  if (st.s.scalar_type() != acc || st.z.scalar_type() != acc) {
    throw std::invalid_argument(fmt::format("fused_linear_attention: initial state must be {} (the accumulators' "
                                            "dtype)", c10::toString(acc)));
  }
  const int64_t o = s.shift ? 1 : 0;
  auto sv = st.s.detach().to(torch::kCPU), zv = st.z.detach().to(torch::kCPU);
  auto s_main = sv.narrow(2, o, s.F).reshape({n_seq, s.heads, s.F * s.d});
  auto z_main = zv.narrow(2, o, s.F);
  auto s0 = s.shift ? sv.select(2, 0) : torch::zeros({n_seq, s.heads, s.d}, sv.options());
  auto z0 = s.shift ? zv.narrow(2, 0, 1) : torch::zeros({n_seq, s.heads, 1}, zv.options());
  return torch::cat({s_main, z_main, s0, z0}, -1).contiguous();
}

LinearAttentionState external_state(const Shape& s, const torch::Tensor& internal) {
  const int64_t n = internal.size(0);
  auto s_main = internal.narrow(-1, 0, s.F * s.d).reshape({n, s.heads, s.F, s.d});
  auto z_main = internal.narrow(-1, s.z_at(), s.F);
  if (!s.shift) return {s_main.contiguous(), z_main.contiguous()};
  auto s0 = internal.narrow(-1, s.s0_at(), s.d).unsqueeze(2);
  auto z0 = internal.narrow(-1, s.z0_at(), 1);
  return {torch::cat({s0, s_main}, 2), torch::cat({z0, z_main}, 2)};
}

template <class In, class T>
Io<In, T> inputs_of(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                    const std::vector<int64_t>& bounds) {
  Io<In, T> io;
  io.q = q.data_ptr<In>();
  io.k = k.data_ptr<In>();
  io.v = v.data_ptr<In>();
  io.sq0 = q.stride(0), io.sq1 = q.stride(1), io.sk0 = k.stride(0), io.sk1 = k.stride(1);
  io.sv0 = v.stride(0), io.sv1 = v.stride(1);
  io.bounds = &bounds;
  return io;
}

torch::Tensor last_dim_contiguous(const torch::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

FusedLinearAttentionGrads backward_impl(const torch::Tensor& dout_in, const torch::Tensor& q_in,
                                        const torch::Tensor& k_in, const torch::Tensor& v_in,
                                        const FusedLinearAttentionResult& saved,
                                        const torch::Tensor& cu, const FusedFeatureMap& map,
                                        const FusedLinearAttentionOptions& options,
                                        const LinearAttentionState* initial, bool omega_grad) {
  const char* who = "fused_linear_attention_backward";
  Prepared p = prepare(who, q_in, k_in, v_in, cu, map, options);
  const auto acc = q_in.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  const torch::Tensor& out_in = saved.out;
  const torch::Tensor& stat = saved.stat;
  if (!dout_in.defined() || !out_in.defined() || dout_in.sizes() != q_in.sizes() || out_in.sizes() != q_in.sizes() ||
      dout_in.scalar_type() != q_in.scalar_type() || out_in.scalar_type() != q_in.scalar_type()) {
    throw std::invalid_argument(fmt::format("{}: dout {} and out {} must match q {} in shape and dtype", who,
                                            shape_str(dout_in), shape_str(out_in), shape_str(q_in)));
  }
  if (!stat.defined() || stat.sizes() != q_in.sizes().slice(0, 2) || stat.scalar_type() != acc) {
    throw std::invalid_argument(fmt::format("{}: stat must be [{}, {}] {}, got {}", who, q_in.size(0), q_in.size(1),
                                            c10::toString(acc), shape_str(stat)));
  }
  const bool bf16 = q_in.scalar_type() == torch::kBFloat16;
  if (saved.out_residual.defined() &&
      (!bf16 || saved.out_residual.sizes() != q_in.sizes() || saved.out_residual.scalar_type() != torch::kBFloat16)) {
    throw std::invalid_argument(fmt::format("{}: out_residual must be bf16 {} for bf16 inputs only, got {}", who,
                                            shape_str(q_in), shape_str(saved.out_residual)));
  }
  Shape& s = p.shape;
  s.omega_grad = omega_grad && s.trig;
  torch::NoGradGuard no_grad;
  const torch::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
  const torch::Tensor dout = last_dim_contiguous(dout_in), out = last_dim_contiguous(out_in);
  const torch::Tensor stat_c = stat.contiguous();
  const torch::Tensor residual = saved.out_residual.defined() ? saved.out_residual.contiguous() : torch::Tensor();
  const int64_t n_seq = static_cast<int64_t>(p.bounds.size()) - 1;
  torch::Tensor init = initial ? internal_state(s, *initial, n_seq, acc) : torch::Tensor();
  // Every token of a non-empty sequence is written by the pass.
  torch::Tensor dq = torch::empty(q.sizes(), q.options());
  torch::Tensor dk = torch::empty(q.sizes(), q.options());
  torch::Tensor dv = torch::empty(q.sizes(), q.options());
  torch::Tensor grads = torch::zeros({s.heads * s.grad_len()}, torch::TensorOptions().dtype(acc));
  // dden per token and head, [T, H] in the accumulator type (2 / head_dim of dq's bytes in bf16, 1 / head_dim in
  // fp32): what lets the second sweep skip reading y (Chunks::output_grads).
  torch::Tensor dden =
      s.has_den ? torch::empty({q.size(0), s.heads}, torch::TensorOptions().dtype(acc)) : torch::Tensor();
  with_path(q.scalar_type(), p.path, [&](auto pol, bool simd, auto in_tag) {
    using P = decltype(pol);
    using In = decltype(in_tag);
    using T = typename P::Acc;
    const Params<T> pr = params_of<T>(s, map);
    Io<In, T> io = inputs_of<In, T>(q, k, v, p.bounds);
    io.dout = dout.data_ptr<In>();
    io.sg0 = dout.stride(0), io.sg1 = dout.stride(1);
    io.y = out.data_ptr<In>();
    io.sy0 = out.stride(0), io.sy1 = out.stride(1);
    io.stat_in = stat_c.data_ptr<T>();
    if (residual.defined()) io.y_lo = residual.data_ptr<In>();
    if (dden.defined()) io.dden = dden.data_ptr<T>();
    io.dq = dq.data_ptr<In>();
    io.dk = dk.data_ptr<In>();
    io.dv = dv.data_ptr<In>();
    backward_pass<P, In>(s, pr, pol, simd, io, init.defined() ? init.data_ptr<T>() : nullptr, grads.data_ptr<T>());
  });
  FusedLinearAttentionGrads g{dq, dk, dv, {}, {}, {}};
  const auto per_head = grads.view({s.heads, s.grad_len()});
  if (s.trig && s.omega_grad) {
    g.domega = per_head.narrow(1, 0, s.m * s.d).reshape({s.heads, s.m, s.d}).to(map.omega.scalar_type());
    if (s.pair) {
      g.domega2 = per_head.narrow(1, s.domega2_at(), s.m * s.d).reshape({s.heads, s.m, s.d})
                      .to(map.omega2.scalar_type());
    }
  }
  if (s.shift) g.dalpha = per_head.select(1, s.dalpha_at()).contiguous().to(map.alpha.scalar_type());
  return g;
}

}  // namespace

const char* to_string(LinearAttentionPath path) {
  switch (path) {
    case LinearAttentionPath::kAuto: return "auto";
    case LinearAttentionPath::kPortable: return "portable";
    case LinearAttentionPath::kAvx512: return "avx512";
    case LinearAttentionPath::kAvx512Bf16: return "avx512-bf16";
    case LinearAttentionPath::kAmx: return "amx";
  }
  return "?";
}

LinearAttentionPath resolve_linear_attention_path(torch::ScalarType dtype, LinearAttentionPath requested) {
  const CpuFeatures& f = cpu_features();
  const bool bf16_simd = avx512_usable() && f.avx512_bf16;
  const bool is_bf16 = dtype == torch::kBFloat16;
  auto refuse = [&](const char* why) {
    return std::invalid_argument(fmt::format("fused_linear_attention: path {} cannot run for {} inputs: {}",
                                             to_string(requested), c10::toString(dtype), why));
  };
  switch (requested) {
    case LinearAttentionPath::kAuto:
      if (dtype == torch::kDouble) return LinearAttentionPath::kPortable;
      if (is_bf16 && amx_usable()) return LinearAttentionPath::kAmx;
      if (is_bf16 && bf16_simd) return LinearAttentionPath::kAvx512Bf16;
      return avx512_usable() ? LinearAttentionPath::kAvx512 : LinearAttentionPath::kPortable;
    case LinearAttentionPath::kPortable: return requested;
    case LinearAttentionPath::kAvx512:
      if (dtype == torch::kDouble) throw refuse("fp64 runs the portable loops only");
      if (!avx512_usable()) throw refuse("this CPU lacks AVX-512 (F, BW, VL)");
      return requested;
    case LinearAttentionPath::kAvx512Bf16:
      if (!is_bf16) throw refuse("bf16 products need bf16 inputs");
      if (!bf16_simd) throw refuse("this CPU lacks AVX512-BF16");
      return requested;
    case LinearAttentionPath::kAmx:
      if (!is_bf16) throw refuse("bf16 products need bf16 inputs");
      if (!amx_usable()) throw refuse("AMX tiles are not usable here (no amx_bf16 in CPUID, or Linux refused tile data)");
      return requested;
  }
  throw refuse("unknown path");
}

int64_t fused_linear_attention_workspace_bytes(torch::ScalarType dtype, LinearAttentionPath path, FeatureMap map,
                                               int64_t head_dim, int64_t num_frequencies, int64_t chunk_size) {
  Shape s;
  s.d = head_dim;
  s.trig = map != FeatureMap::kElu;
  s.m = s.trig ? num_frequencies : 0;
  s.F = s.trig ? 2 * s.m : head_dim;
  s.C = chunk_size;
  int64_t bytes = 0;
  with_path(dtype, resolve_linear_attention_path(dtype, path), [&](auto pol, bool, auto) {
    bytes = tile_bytes<decltype(pol)>(s) + 64;
  });
  return bytes;
}

FusedLinearAttentionResult fused_linear_attention_forward(const torch::Tensor& q_in, const torch::Tensor& k_in,
                                                          const torch::Tensor& v_in, const torch::Tensor& cu_seqlens,
                                                          const FusedFeatureMap& map,
                                                          const FusedLinearAttentionOptions& options,
                                                          const LinearAttentionState* initial,
                                                          bool return_final_state) {
  Prepared p = prepare("fused_linear_attention_forward", q_in, k_in, v_in, cu_seqlens, map, options);
  const Shape& s = p.shape;
  const auto acc = q_in.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  torch::NoGradGuard no_grad;
  const torch::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
  const int64_t n_seq = static_cast<int64_t>(p.bounds.size()) - 1;
  torch::Tensor init = initial ? internal_state(s, *initial, n_seq, acc) : torch::Tensor();
  torch::Tensor out = torch::empty(q.sizes(), q.options());
  torch::Tensor stat = torch::empty({q.size(0), q.size(1)}, q.options().dtype(acc));
  torch::Tensor residual = q.scalar_type() == torch::kBFloat16 ? torch::empty(q.sizes(), q.options()) : torch::Tensor();
  // Empty sequences keep their initial (or zero) state.
  torch::Tensor finals;
  if (return_final_state) finals = init.defined() ? init.clone() : torch::zeros({n_seq, s.heads, s.state_len()}, acc);
  with_path(q.scalar_type(), p.path, [&](auto pol, bool simd, auto in_tag) {
    using P = decltype(pol);
    using In = decltype(in_tag);
    using T = typename P::Acc;
    const Params<T> pr = params_of<T>(s, map);
    Io<In, T> io = inputs_of<In, T>(q, k, v, p.bounds);
    io.out = out.data_ptr<In>();
    if (residual.defined()) io.out_lo = residual.data_ptr<In>();
    io.stat = stat.data_ptr<T>();
    forward_pass<P, In>(s, pr, pol, simd, io, init.defined() ? init.data_ptr<T>() : nullptr,
                        finals.defined() ? finals.data_ptr<T>() : nullptr);
  });
  FusedLinearAttentionResult r{out, stat, residual, {}};
  if (return_final_state) r.final_state = external_state(s, finals);
  return r;
}

FusedLinearAttentionGrads fused_linear_attention_backward(const torch::Tensor& dout, const torch::Tensor& q,
                                                          const torch::Tensor& k, const torch::Tensor& v,
                                                          const FusedLinearAttentionResult& saved,
                                                          const torch::Tensor& cu_seqlens, const FusedFeatureMap& map,
                                                          const FusedLinearAttentionOptions& options,
                                                          const LinearAttentionState* initial) {
  return backward_impl(dout, q, k, v, saved, cu_seqlens, map, options, initial, /*omega_grad=*/true);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Undefined optional tensors travel through the autograd Function as empty placeholders.
torch::Tensor placeholder(const torch::Tensor& t) { return t.defined() ? t : torch::empty({0}); }
torch::Tensor restored(const torch::Tensor& t) { return t.numel() == 0 && t.dim() == 1 ? torch::Tensor() : t; }

struct FusedLinearAttentionFunction : torch::autograd::Function<FusedLinearAttentionFunction> {
  static FusedFeatureMap map_of(const variable_list& x, int64_t feature_map, int64_t input_norm, int64_t normalizer) {
    FusedFeatureMap map;
    map.feature_map = static_cast<FeatureMap>(feature_map);
    map.input_norm = static_cast<InputNorm>(input_norm);
    map.normalizer = static_cast<Normalizer>(normalizer);
    map.omega = restored(x[0]);
    map.omega2 = restored(x[1]);
    map.alpha = restored(x[2]);
    map.key_offset = restored(x[3]);
    return map;
  }

  static variable_list forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& omega, const torch::Tensor& omega2,
                               const torch::Tensor& alpha, const torch::Tensor& key_offset, const torch::Tensor& cu,
                               const torch::Tensor& init_s, const torch::Tensor& init_z, int64_t feature_map,
                               int64_t input_norm, int64_t normalizer, int64_t chunk_size, int64_t path,
                               bool want_final) {
    const FusedFeatureMap map = map_of({omega, omega2, alpha, key_offset}, feature_map, input_norm, normalizer);
    const FusedLinearAttentionOptions options{chunk_size, static_cast<LinearAttentionPath>(path)};
    const LinearAttentionState init{restored(init_s), restored(init_z)};
    const LinearAttentionState* initial = init.s.defined() ? &init : nullptr;
    FusedLinearAttentionResult r = fused_linear_attention_forward(q, k, v, cu, map, options, initial, want_final);
    ctx->save_for_backward({q, k, v, r.out, r.stat, omega, omega2, alpha, key_offset, cu, init_s, init_z,
                            placeholder(r.out_residual)});
    ctx->saved_data["feature_map"] = feature_map;
    ctx->saved_data["input_norm"] = input_norm;
    ctx->saved_data["normalizer"] = normalizer;
    ctx->saved_data["chunk_size"] = chunk_size;
    ctx->saved_data["path"] = path;
    if (!want_final) return {r.out};
    ctx->mark_non_differentiable({r.final_state.s, r.final_state.z});
    return {r.out, r.final_state.s, r.final_state.z};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto x = ctx->get_saved_variables();
    const FusedFeatureMap map = map_of({x[5], x[6], x[7], x[8]}, ctx->saved_data["feature_map"].toInt(),
                                       ctx->saved_data["input_norm"].toInt(), ctx->saved_data["normalizer"].toInt());
    const FusedLinearAttentionOptions options{ctx->saved_data["chunk_size"].toInt(),
                                              static_cast<LinearAttentionPath>(ctx->saved_data["path"].toInt())};
    const LinearAttentionState init{restored(x[10]), restored(x[11])};
    const torch::Tensor dout = grads[0].defined() ? grads[0] : torch::zeros_like(x[3]);
    const bool omega_grad = ctx->needs_input_grad(3) || ctx->needs_input_grad(4);
    FusedLinearAttentionResult saved;
    saved.out = x[3];
    saved.stat = x[4];
    saved.out_residual = restored(x[12]);
    FusedLinearAttentionGrads g =
        backward_impl(dout, x[0], x[1], x[2], saved, x[9], map, options, init.s.defined() ? &init : nullptr, omega_grad);
    return {g.dq, g.dk, g.dv, g.domega, g.domega2, g.dalpha, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}};
  }
};

}  // namespace

torch::Tensor fused_linear_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     const torch::Tensor& cu_seqlens, const FusedFeatureMap& map,
                                     const FusedLinearAttentionOptions& options, const LinearAttentionState* initial,
                                     LinearAttentionState* final_state) {
  const variable_list r = FusedLinearAttentionFunction::apply(
      q, k, v, placeholder(map.omega), placeholder(map.omega2), placeholder(map.alpha), placeholder(map.key_offset),
      cu_seqlens, placeholder(initial ? initial->s : torch::Tensor()),
      placeholder(initial ? initial->z : torch::Tensor()), static_cast<int64_t>(map.feature_map),
      static_cast<int64_t>(map.input_norm), static_cast<int64_t>(map.normalizer), options.chunk_size,
      static_cast<int64_t>(options.path), final_state != nullptr);
  if (final_state) *final_state = {r[1], r[2]};
  return r[0];
}

}  // namespace dcp
