#include "dcp/sequence_parallel.h"

#include <fmt/format.h>

#include "dist/ulysses_exchange.h"

namespace dcp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// AutogradContext stores IValues only; the group travels as a capsule.
struct GroupHolder : torch::CustomClassHolder {
  explicit GroupHolder(const Communicator& g) : group(g) {}
  const Communicator& group;
};

struct AllToAllFunction : torch::autograd::Function<AllToAllFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const Communicator& group) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupHolder>(group));
    return group.all_to_all(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto holder = c10::static_intrusive_pointer_cast<GroupHolder>(ctx->saved_data["group"].toCapsule());
    return {holder->group.all_to_all(grad_outputs[0]), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor all_to_all(const torch::Tensor& x, const Communicator& group) {
  if (group.size() == 1) return x;
  return AllToAllFunction::apply(x, group);
}

SequenceParallelAttention::SequenceParallelAttention(const Communicator& group) : group_(group) {}

SequenceParallelAttention::SequenceParallelAttention(std::shared_ptr<const AttentionBackend> inner,
                                                     const Communicator& group)
    : inner_(std::move(inner)), group_(group) {}

torch::Tensor SequenceParallelAttention::forward(const torch::Tensor& q, const torch::Tensor& k,
                                                 const torch::Tensor& v, const torch::Tensor& cu_seqlens) const {
  if (!inner_) throw std::logic_error("SequenceParallelAttention: no backend was given at construction");
  return forward(*inner_, 0, q, k, v, cu_seqlens);
}

std::array<torch::Tensor, 3> ulysses_to_heads(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                              const Communicator& group) {
  const int64_t sp = group.size(), local = q.size(0), heads = q.size(1), head_dim = q.size(2);
  if (heads % sp != 0) {
    throw std::invalid_argument(fmt::format(
        "sequence parallelism: n_heads {} is not divisible by the Ulysses group size {} (Ulysses shards attention "
        "by heads; sp_mode ring does not)",
        heads, sp));
  }
  const int64_t part = heads / sp;
  const int64_t kv_heads = k.size(1);
  if (kv_heads != heads) {
    // Grouped-query attention: member j takes query heads [j H/sp, (j+1) H/sp) and the K/V heads that serve
    // them, [j Hkv/sp, (j+1) Hkv/sp) (aligned because Hkv/sp divides H/sp), so K/V travel at their own width.
    if (kv_heads < 1 || heads % kv_heads != 0 || kv_heads % sp != 0 || v.size(1) != kv_heads) {
      throw std::invalid_argument(fmt::format(
          "sequence parallelism: {} K/V heads (v {}) do not divide into the Ulysses group size {} with {} query heads "
          "(Ulysses shards K/V heads too; sp_mode ring does not)",
          kv_heads, v.size(1), sp, heads));
    }
    const int64_t kv_part = kv_heads / sp;
    // [T_local, sp, H/sp + 2 Hkv/sp, D] -> [sp, T_local, ...]: chunk j holds member j's query, key, value heads.
    auto chunk = torch::cat({q.view({local, sp, part, head_dim}), k.view({local, sp, kv_part, head_dim}),
                             v.view({local, sp, kv_part, head_dim})},
                            2)
                     .permute({1, 0, 2, 3});
    auto full = all_to_all(chunk.contiguous(), group).view({sp * local, part + 2 * kv_part, head_dim});
    return {full.narrow(1, 0, part), full.narrow(1, part, kv_part), full.narrow(1, part + kv_part, kv_part)};
  }
  // [T_local, 3, sp, H/sp, D] -> [sp, T_local, 3, H/sp, D]: chunk j holds the heads member j attends over.
  auto qkv = torch::stack({q, k, v}, 1).view({local, 3, sp, part, head_dim}).permute({2, 0, 1, 3, 4});
  // Received chunk j is member j's shard of the sequence, so the result is the group's tokens in order.
  auto full = all_to_all(qkv.contiguous(), group).view({sp * local, 3, part, head_dim}).unbind(1);
  return {full[0], full[1], full[2]};
}

torch::Tensor ulysses_to_tokens(const torch::Tensor& out, const Communicator& group) {
  const int64_t sp = group.size(), local = out.size(0) / sp, part = out.size(1), head_dim = out.size(2);
  // Chunk j = member j's tokens; received chunk i = head slice i of this rank's tokens.
  auto back = all_to_all(out.contiguous(), group).view({sp, local, part, head_dim});
  return back.permute({1, 0, 2, 3}).reshape({local, sp * part, head_dim});
}

torch::Tensor SequenceParallelAttention::forward(const AttentionBackend& inner, int64_t /*layer*/,
                                                 const torch::Tensor& q, const torch::Tensor& k,
                                                 const torch::Tensor& v, const torch::Tensor& cu_seqlens) const {
  auto [qh, kh, vh] = ulysses_to_heads(q, k, v, group_);
  // This rank received head chunk `rank` from every member: heads [rank * part, (rank + 1) * part).
  auto out = inner.forward_heads(qh, kh, vh, cu_seqlens, group_.rank() * qh.size(1));  // [T_pad, H/sp, D]
  return ulysses_to_tokens(out, group_);
}

}  // namespace dcp
