#include "tools/sp_attention_bench.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <thread>

#include "dcp/cpu_features.h"
#include "dcp/model.h"
#include "dcp/plan.h"
#include "dcp/sequence_parallel.h"
#include "tools/bench_common.h"
#include "util/clock.h"
#include "util/stats.h"

namespace dcp {
namespace {

// The slowest rank's value.
double slowest(double seconds, const Communicator& world) {
  auto t = torch::tensor({seconds}, torch::kDouble);
  world.allreduce_max(t);
  return t.item<double>();
}

torch::ScalarType dtype_of(const std::string& name) {
  if (name == "fp32") return torch::kFloat;
  if (name == "bf16") return torch::kBFloat16;
  throw std::invalid_argument(fmt::format("bench-sp-attention: unknown dtype '{}' (allowed: fp32, bf16)", name));
}

torch::Tensor pieces_of(const torch::Tensor& t, const std::vector<std::pair<int64_t, int64_t>>& pieces) {
  std::vector<torch::Tensor> parts;
  for (const auto& [b, e] : pieces) parts.push_back(t.slice(0, b, e));
  return torch::cat(parts).contiguous();
}

// The transfers of one forward + backward of `layout`, without the attention between them.
double transfers_alone(const SpLayout& layout, const ProcessGroups& groups, int64_t local, int64_t heads,
                       int64_t head_dim, torch::ScalarType dtype) {
  const Communicator& group = groups.group(layout.sp_size);
  const auto opts = torch::dtype(dtype);
  group.barrier();
  const auto start = std::chrono::steady_clock::now();
  const int64_t u = layout.ulysses_size, r = layout.ring_size();
  if (u > 1) {  // q, k, v stacked, and the output: forward, and the same on the gradients in backward
    const Communicator& sub = groups.group(u);
    for (int pass = 0; pass < 2; ++pass) {  // the shapes ulysses_to_heads / ulysses_to_tokens exchange
      sub.all_to_all(torch::zeros({u, local, 3, heads / u, head_dim}, opts));
      sub.all_to_all(torch::zeros({u * local, heads / u, head_dim}, opts));
    }
  }
  if (r > 1) {
    const int64_t position = group.rank() / u, member = group.rank() % u;
    const int64_t next = (position + 1) % r * u + member, prev = (position + r - 1) % r * u + member;
    const int64_t rows = local * u;  // the subgroup's tokens, for heads / u heads
    auto kv = torch::zeros({2, rows, heads / u, head_dim}, opts);
    for (int64_t i = 0; i + 1 < r; ++i) kv = group.exchange(kv, next, prev).wait();
    auto dkv = torch::zeros({2, rows, heads / u, head_dim}, torch::kFloat);
    Communicator::Exchange kv_pending, dkv_pending;
    for (int64_t i = 0; i < r; ++i) {
      if (i + 1 < r) kv_pending = group.exchange(kv, next, prev);
      if (i > 0) dkv = dkv_pending.wait();
      dkv_pending = group.exchange(dkv, next, prev);
      if (i + 1 < r) kv = kv_pending.wait();
    }
    dkv_pending.wait();
  }
  return seconds_since(start);
}

double transfer_bytes(const SpLayout& layout, int64_t local, int64_t heads, int64_t head_dim, int64_t element) {
  const int64_t u = layout.ulysses_size, r = layout.ring_size();
  const double block = static_cast<double>(local * heads * head_dim);  // elements of one [local, H, D] tensor
  double bytes = 0;
  if (u > 1) bytes += 2.0 * 4.0 * block * element * (u - 1) / u;  // (q, k, v) + out, forward and backward
  // A ring block is the subgroup's tokens for H / u heads: as many elements as this rank's [local, H, D].
  if (r > 1) bytes += 2.0 * block * ((r - 1) * 2.0 * element + r * 4.0);  // kv fwd, kv bwd, fp32 dkv
  return bytes;
}

}  // namespace

std::vector<std::pair<std::string, GroupPlan>> check_sp_attention_bench(const SpAttentionBenchOptions& o, int64_t sp) {
  if (sp < 2) throw std::invalid_argument("bench-sp-attention: run it under `dcp launch --nproc N` with N >= 2");
  dtype_of(o.dtype);
  for (int64_t length : o.lengths) {
    if (length < 2 * sp) {
      throw std::invalid_argument(
          fmt::format("bench-sp-attention: --lengths {} is shorter than 2 x ranks = {}", length, 2 * sp));
    }
  }
  std::vector<std::pair<std::string, GroupPlan>> out;
  for (const auto& name : o.modes) {
    GroupPlan g{0, sp, {}, sp_mode_from_name(name)};
    if (g.sp_mode == SpMode::kUlyssesRing) {
      g.ulysses_size = ulysses_ring_size(sp, o.ulysses_size, o.heads);
      if (g.ulysses_size == 0) {
        throw std::invalid_argument(fmt::format(
            "bench-sp-attention: --modes ulysses-ring at {} ranks with --heads {} has no subgroup size (--ulysses-size "
            "{}; allowed: a divisor of both strictly between 1 and {}, 0 = the largest)",
            sp, o.heads, o.ulysses_size, sp));
      }
    }
    if (!layout_fits_heads(g.layout(), o.heads)) {
      throw std::invalid_argument(fmt::format(
          "bench-sp-attention: --modes {} shards --heads {} over {} ranks (Ulysses needs them to divide the heads)", name,
          o.heads, g.layout().ulysses_size));
    }
    out.emplace_back(name, g);
  }
  return out;
}

std::vector<SpAttentionBenchPoint> bench_sp_attention(const SpAttentionBenchOptions& o, const ProcessGroups& groups) {
  const Communicator& world = groups.world();
  const int64_t sp = world.size();
  const auto dtype = dtype_of(o.dtype);
  const std::vector<std::pair<std::string, GroupPlan>> groups_of_mode = check_sp_attention_bench(o, sp);
  auto softmax = std::make_shared<SoftmaxAttention>(SoftmaxAttention::Impl::tiled, o.attention);
  std::vector<SpAttentionBenchPoint> out;
  for (int64_t length : o.lengths) {
    torch::manual_seed(o.seed + static_cast<uint64_t>(length));  // the same sequence on every rank
    const auto opts = torch::dtype(dtype);
    auto q = torch::randn({length, o.heads, o.head_dim}, opts), k = torch::randn_like(q), v = torch::randn_like(q),
         g = torch::randn_like(q);
    auto timed = [&](const std::string& mode, const std::function<std::pair<double, double>()>& run, double comm,
                     double bytes) {
      std::vector<double> fwd, bwd, sum;
      for (int64_t rep = 0; rep <= o.repetitions; ++rep) {
        auto [f, b] = run();
        if (rep == 0) continue;  // warm-up
        fwd.push_back(f);
        bwd.push_back(b);
        sum.push_back(f + b);
      }
      out.push_back({mode, length, median(fwd), median(bwd), median(sum), comm, bytes});
    };
    if (o.one_rank) {
      timed("one rank", [&] {
        double f = 0, b = 0;
        world.barrier();
        if (world.rank() == 0) {
          auto qq = q.clone().requires_grad_(), kk = k.clone().requires_grad_(), vv = v.clone().requires_grad_();
          const torch::Tensor cu = torch::tensor({int64_t{0}, length}, torch::kInt64);
          auto start = std::chrono::steady_clock::now();
          auto res = softmax->forward(qq, kk, vv, cu);
          f = seconds_since(start);
          start = std::chrono::steady_clock::now();
          res.backward(g);
          b = seconds_since(start);
        }
        return std::pair{slowest(f, world), slowest(b, world)};
      }, 0, 0);
    }
    for (const auto& [mode, plan] : groups_of_mode) {
      const SpLayout layout = plan.layout();
      const int64_t padded = layout.padded_length(length);
      const auto cu = torch::tensor(padded > length ? std::vector<int64_t>{0, length, padded}
                                                    : std::vector<int64_t>{0, length}, torch::kInt64);
      const auto pad = [&](const torch::Tensor& t) {
        return torch::cat({t, torch::zeros({padded - length, o.heads, o.head_dim}, t.options())});
      };
      const auto pieces = layout.shard(padded, world.rank());
      const auto lq = pieces_of(pad(q), pieces), lk = pieces_of(pad(k), pieces), lv = pieces_of(pad(v), pieces),
                 lg = pieces_of(pad(g), pieces);
      const auto wrapper = group_attention(layout, groups);
      const int64_t local = padded / sp;
      std::vector<double> comm;
      for (int64_t rep = 0; rep <= o.repetitions; ++rep) {
        comm.push_back(slowest(transfers_alone(layout, groups, local, o.heads, o.head_dim, dtype), world));
      }
      comm.erase(comm.begin());
      timed(mode, [&] {
        auto qq = lq.clone().requires_grad_(), kk = lk.clone().requires_grad_(), vv = lv.clone().requires_grad_();
        world.barrier();
        auto start = std::chrono::steady_clock::now();
        auto res = wrapper->forward(*softmax, 0, qq, kk, vv, cu);
        const double f = seconds_since(start);
        start = std::chrono::steady_clock::now();
        res.backward(lg);
        const double b = seconds_since(start);
        return std::pair{slowest(f, world), slowest(b, world)};
      }, median(comm), transfer_bytes(layout, local, o.heads, o.head_dim, dtype == torch::kFloat ? 4 : 2));
    }
  }
  return out;
}

std::string sp_attention_bench_tables(const std::vector<SpAttentionBenchPoint>& points, int64_t sp) {
  std::map<int64_t, std::map<std::string, const SpAttentionBenchPoint*>> by_length;
  std::vector<std::string> modes;
  for (const auto& p : points) {
    by_length[p.length][p.mode] = &p;
    if (p.mode != "one rank" && std::find(modes.begin(), modes.end(), p.mode) == modes.end()) modes.push_back(p.mode);
  }
  std::string s = "| length | one rank fwd+bwd |";
  std::string rule = "|---|---|";
  for (const auto& m : modes) {
    s += fmt::format(" {m} fwd / bwd | {m} fwd+bwd | {m} / ulysses | {m} efficiency | {m} transfers alone (share) |",
                     fmt::arg("m", m));
    rule += "---|---|---|---|---|";
  }
  s += "\n" + rule + "\n";
  for (const auto& [length, at] : by_length) {
    const auto one = at.find("one rank");
    s += fmt::format("| {} | {} |", length, one == at.end() ? "-" : fmt::format("{:.3f} s", one->second->seconds));
    const auto ulysses = at.find("ulysses");
    for (const auto& m : modes) {
      const auto it = at.find(m);
      if (it == at.end()) {
        s += " - | - | - | - | - |";
        continue;
      }
      const SpAttentionBenchPoint& p = *it->second;
      s += fmt::format(" {:.3f} / {:.3f} s | {:.3f} s | {} | {} | {:.3f} s ({:.0f}%, {:.1f} MB) |", p.forward_seconds,
                       p.backward_seconds, p.seconds,
                       ulysses == at.end() ? "-" : fmt::format("{:.2f}x", p.seconds / ulysses->second->seconds),
                       one == at.end() ? "-" : fmt::format("{:.0f}%", 100.0 * one->second->seconds / sp / p.seconds),
                       p.comm_seconds, 100.0 * p.comm_seconds / p.seconds, p.comm_bytes / 1e6);
    }
    s += "\n";
  }
  return s;
}

std::string sp_attention_bench_csv(const std::vector<SpAttentionBenchPoint>& points) {
  std::string s = "mode,length,forward_seconds,backward_seconds,seconds,comm_seconds,comm_bytes\n";
  for (const auto& p : points) {
    s += fmt::format("{},{},{:.6f},{:.6f},{:.6f},{:.6f},{:.0f}\n", p.mode, p.length, p.forward_seconds,
                     p.backward_seconds, p.seconds, p.comm_seconds, p.comm_bytes);
  }
  return s;
}

std::string sp_attention_bench_markdown(const SpAttentionBenchOptions& o, const std::vector<SpAttentionBenchPoint>& points,
                                        int64_t sp, int64_t threads, const std::string& date, double load_start,
                                        double load_end, double wall_s, const std::string& note) {
  return fmt::format(
      "# dcp bench-sp-attention: sp {sp}, {modes}, {dtype}, {heads} heads x head_dim {dim}, {first} to {last} tokens\n\n"
      "Command:\n\n```\n{cmd}\n```\n\n"
      "Date: {date} UTC. Machine: {hw} hardware threads, {sp} ranks of {threads} intra-op thread(s) each (Gloo over "
      "127.0.0.1); CPU features: {features}; 1-minute load average {l0:.2f} at the start, {l1:.2f} at the end; the run "
      "took {wall:.0f} s.{note}\n\n"
      "Setup: one causal sequence of L tokens (cu_seqlens {{0, L}}, padded as the mode needs), q, k, v and the "
      "output gradient ~ N(0, 1) in {dtype}, identical on every rank; each rank holds its shard (Ulysses: "
      "contiguous L / sp; ring: zigzag chunks r and 2 sp - 1 - r of 2 sp) and runs the mode's wrapper around the "
      "tiled softmax (tiles {tq} x {tk}), forward, then backward with its shard of the gradient. Times: the "
      "slowest rank per run, median of {reps} runs after one warm-up. 'one rank': the whole sequence on rank 0 "
      "alone (the others wait), so efficiency = one-rank time / sp / the mode's time (1 = perfect scaling; "
      "ring-flash-attention's table reports the same ratio on GPUs). Transfers alone: the mode's messages of one "
      "forward + backward (Ulysses: 2 all-to-alls each way; ring: sp - 1 key/value blocks forward, sp - 1 blocks "
      "and sp fp32 dK/dV blocks backward) with no attention between them, so share = how much of the time would be "
      "communication if none of it overlapped; MB = bytes leaving a rank.\n\n{tables}",
      fmt::arg("sp", sp), fmt::arg("modes", fmt::join(o.modes, " vs ")), fmt::arg("dtype", o.dtype),
      fmt::arg("heads", o.heads), fmt::arg("dim", o.head_dim), fmt::arg("first", o.lengths.front()),
      fmt::arg("last", o.lengths.back()), fmt::arg("cmd", own_command_line()), fmt::arg("date", date),
      fmt::arg("hw", std::thread::hardware_concurrency()), fmt::arg("threads", threads),
      fmt::arg("features", cpu_features().summary()), fmt::arg("l0", load_start), fmt::arg("l1", load_end),
      fmt::arg("wall", wall_s), fmt::arg("note", note.empty() ? "" : " " + note), fmt::arg("tq", o.attention.tile_q),
      fmt::arg("tk", o.attention.tile_k), fmt::arg("reps", o.repetitions),
      fmt::arg("tables", sp_attention_bench_tables(points, sp)));
}

}  // namespace dcp
