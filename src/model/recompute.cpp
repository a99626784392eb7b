#include "dcp/model.h"

namespace dcp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Fn = std::function<torch::Tensor(const torch::Tensor&)>;

// AutogradContext only stores IValues; a capsule is the way to keep an arbitrary C++ callable there.
struct FnHolder : torch::CustomClassHolder {
  explicit FnHolder(Fn f) : fn(std::move(f)) {}
  Fn fn;
};

struct RecomputeFunction : torch::autograd::Function<RecomputeFunction> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const Fn& fn) {
    ctx->save_for_backward({x});
    ctx->saved_data["fn"] = c10::IValue::make_capsule(c10::make_intrusive<FnHolder>(fn));
    torch::NoGradGuard no_grad;
    return fn(x);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const torch::Tensor& grad_out = grad_outputs[0];
    if (!grad_out.defined()) return {torch::Tensor(), torch::Tensor()};
    auto holder = c10::static_intrusive_pointer_cast<FnHolder>(ctx->saved_data["fn"].toCapsule());
    torch::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    torch::Tensor y;
    {
      // The engine runs backward with grad mode off; the rerun must build a graph to differentiate.
      torch::AutoGradMode enable_grad(true);
      y = holder->fn(x);
    }
    // Reentrant backward, as PyTorch's reentrant checkpoint does: parameter grads accumulate into .grad.
    torch::autograd::backward({y}, {grad_out});
    return {x.grad(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor recompute(const Fn& fn, const torch::Tensor& x) {
  if (!torch::GradMode::is_enabled() || !x.requires_grad()) return fn(x);
  return RecomputeFunction::apply(x, fn);
}

}  // namespace dcp
