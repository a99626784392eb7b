// Zigzag ring attention and its Ulysses x ring combination (include/dcp/sequence_parallel.h).
#include <fmt/format.h>
#include <torch/torch.h>

#include <limits>

#include "dcp/sequence_parallel.h"
#include "dist/ring_blocks.h"
#include "dist/ulysses_exchange.h"

namespace dcp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What both passes need; AutogradContext stores IValues only, so it travels as a capsule.
struct Ring : torch::CustomClassHolder {
  Ring(const Communicator& g, int64_t stride, AttentionOptions o) : group(g), options(std::move(o)) {
    size = g.size() / stride;
    position = g.rank() / stride;
    const int64_t member = g.rank() % stride;
    next = (position + 1) % size * stride + member;
    prev = (position + size - 1) % size * stride + member;
  }
  const Communicator& group;
  AttentionOptions options;
  int64_t size = 1, position = 0, next = 0, prev = 0;
  std::vector<RingBlock> blocks;  // blocks[i]: step i, the block of ring position (position - i) mod size

  int64_t source(int64_t step) const { return (position - step + size) % size; }
};

torch::Tensor rows(const torch::Tensor& t, int64_t begin, int64_t end) { return t.slice(0, begin, end); }

// Grouped-query attention: the ring carries K/V at their own head count; a block's K/V are expanded to the
// query heads for the operator (expand_kv_heads), and its dK/dV summed back over each group.
torch::Tensor reduce_kv_heads(const torch::Tensor& dx, int64_t kv_heads) {
  if (dx.size(1) == kv_heads) return dx;
  return dx.view({dx.size(0), kv_heads, dx.size(1) / kv_heads, dx.size(2)}).sum(2);
}
torch::Tensor host(const std::vector<int64_t>& v) { return torch::tensor(v, torch::kInt64); }

struct RingFunction : torch::autograd::Function<RingFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const c10::intrusive_ptr<Ring>& ring) {
    const auto acc = q.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
    auto out = torch::zeros(q.sizes(), q.options().dtype(acc));
    auto lse = torch::full({q.size(0), q.size(1)}, -std::numeric_limits<double>::infinity(), q.options().dtype(acc));
    torch::Tensor kv = torch::stack({k, v});
    for (int64_t i = 0; i < ring->size; ++i) {
      Communicator::Exchange pending;
      if (i + 1 < ring->size) pending = ring->group.exchange(kv, ring->next, ring->prev);  // hidden behind this block
      const RingBlock& b = ring->blocks[static_cast<size_t>(i)];
      if (!b.empty) {
        const int64_t heads = q.size(1);
        AttentionResult part = tiled_attention_forward(
            rows(q, b.q_begin, b.q_end), expand_kv_heads(rows(kv[0], b.k_begin, b.k_end), heads),
            expand_kv_heads(rows(kv[1], b.k_begin, b.k_end), heads), host(b.cu_q), host(b.cu_k), b.causal,
            ring->options);
        auto o = rows(out, b.q_begin, b.q_end), l = rows(lse, b.q_begin, b.q_end);
        AttentionResult merged = merge_attention({o, l}, {part.out.to(acc), part.lse.to(acc)});
        o.copy_(merged.out);
        l.copy_(merged.lse);
      }
      if (i + 1 < ring->size) kv = pending.wait();
    }
    auto result = out.to(q.scalar_type());
    ctx->save_for_backward({q, k, v, result, lse});
    ctx->saved_data["ring"] = c10::IValue::make_capsule(ring);
    return result;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    auto ring = c10::static_intrusive_pointer_cast<Ring>(ctx->saved_data["ring"].toCapsule());
    const torch::Tensor dout = grad_outputs[0].to(q.scalar_type()).contiguous();
    const auto acc = lse.scalar_type();
    auto dq = torch::zeros(q.sizes(), q.options().dtype(acc));
    torch::Tensor kv = torch::stack({k, v});
    torch::Tensor dkv = torch::zeros(kv.sizes(), kv.options().dtype(acc));  // gradients of the block held
    Communicator::Exchange kv_pending, dkv_pending;
    for (int64_t i = 0; i < ring->size; ++i) {
      if (i + 1 < ring->size) kv_pending = ring->group.exchange(kv, ring->next, ring->prev);
      const RingBlock& b = ring->blocks[static_cast<size_t>(i)];
      AttentionGrads g;
      if (!b.empty) {
        const int64_t heads = q.size(1);
        g = tiled_attention_backward(rows(dout, b.q_begin, b.q_end), rows(q, b.q_begin, b.q_end),
                                     expand_kv_heads(rows(kv[0], b.k_begin, b.k_end), heads),
                                     expand_kv_heads(rows(kv[1], b.k_begin, b.k_end), heads),
                                     rows(out, b.q_begin, b.q_end), rows(lse, b.q_begin, b.q_end),
                                     host(b.cu_q), host(b.cu_k), b.causal, ring->options);
        g.dk = reduce_kv_heads(g.dk, k.size(1));
        g.dv = reduce_kv_heads(g.dv, k.size(1));
      }
      // The accumulator of this step's block comes from the previous position, which added its share.
      if (i > 0) dkv = dkv_pending.wait();
      if (!b.empty) {
        rows(dq, b.q_begin, b.q_end).add_(g.dq.to(acc));
        rows(dkv[0], b.k_begin, b.k_end).add_(g.dk.to(acc));
        rows(dkv[1], b.k_begin, b.k_end).add_(g.dv.to(acc));
      }
      // Passed on with its block; after the last step it goes to its owner, the next position.
      if (ring->size > 1) dkv_pending = ring->group.exchange(dkv, ring->next, ring->prev);
      if (i + 1 < ring->size) kv = kv_pending.wait();
    }
    if (ring->size > 1) dkv = dkv_pending.wait();
    return {dq.to(q.scalar_type()), dkv[0].to(k.scalar_type()), dkv[1].to(v.scalar_type()), torch::Tensor()};
  }
};

}  // namespace

RingAttention::RingAttention(const Communicator& group, const Communicator& ulysses, SpLayout layout)
    : group_(group), ulysses_(ulysses), layout_(layout) {
  if (group.size() != layout.sp_size || ulysses.size() != layout.ulysses_size || layout.ring_size() < 2 ||
      layout.sp_size % layout.ulysses_size != 0) {
    throw std::invalid_argument(fmt::format(
        "RingAttention: groups of {} and {} members do not match a layout of sp_size {} with ulysses_size {} (a ring "
        "needs at least 2 positions)",
        group.size(), ulysses.size(), layout.sp_size, layout.ulysses_size));
  }
}

torch::Tensor RingAttention::forward(const AttentionBackend& inner, int64_t /*layer*/, const torch::Tensor& q,
                                     const torch::Tensor& k, const torch::Tensor& v,
                                     const torch::Tensor& cu_seqlens) const {
  const auto* softmax = dynamic_cast<const SoftmaxAttention*>(&inner);
  if (softmax == nullptr) {
    throw std::invalid_argument(
        "ring attention needs the softmax backend (attention.backend softmax): it merges partial results by their "
        "logsumexps");
  }
  const auto cu = cu_seqlens.to(torch::kCPU).contiguous();
  std::vector<int64_t> stream(cu.data_ptr<int64_t>(), cu.data_ptr<int64_t>() + cu.numel());
  if (stream.empty() || stream.back() != q.size(0) * layout_.sp_size) {
    throw std::invalid_argument(fmt::format(
        "ring attention: cu_seqlens ends at {} but {} ranks hold {} tokens each (the padded stream)",
        stream.empty() ? 0 : stream.back(), layout_.sp_size, q.size(0)));
  }
  auto ring = c10::make_intrusive<Ring>(group_, layout_.ulysses_size, softmax->options());
  for (int64_t i = 0; i < ring->size; ++i) {
    ring->blocks.push_back(ring_block(stream, ring->size, ring->position, ring->source(i)));
  }
  if (layout_.ulysses_size == 1) return RingFunction::apply(q, k, v, ring);
  auto [qh, kh, vh] = ulysses_to_heads(q, k, v, ulysses_);
  return ulysses_to_tokens(RingFunction::apply(qh, kh, vh, ring), ulysses_);
}

std::shared_ptr<const AttentionWrapper> group_attention(const SpLayout& layout, const ProcessGroups& groups) {
  if (layout.sp_size == 1) return nullptr;
  if (layout.ring_size() == 1) return std::make_shared<SequenceParallelAttention>(groups.group(layout.sp_size));
  return std::make_shared<RingAttention>(groups.group(layout.sp_size), groups.group(layout.ulysses_size), layout);
}

}  // namespace dcp
