// The lpsim ops' kernels at the Autograd and ADInplaceOrView keys, all in C++: a Python kernel
// there (torch.library.register_autograd) costs a Python frame and an autograd.Function per call,
// about 24 us, even under torch.no_grad() (benchmarks/bench_overhead.py; docs/performance.md).
//
// Straight-through ops (quantize_grid, quantize_block, quantize_scaled, sr_add): the gradient with
// respect to each of the op's first `inputs` arguments (x; sr_add's a and b) is the incoming
// gradient, in that argument's dtype; the other arguments have none. With grad mode on and one of
// those inputs requiring grad, the result's grad_fn is a StraightThrough node with an edge to each.
// In forward mode (dual tensors, torch.func.jvp, jacfwd, hessian) the result's tangent is the sum
// of those inputs' tangents.
//
// to_container is straight-through too. The ops without a derivative (kUndifferentiableOps:
// mac_matmul, sum_rounded, dot_rounded, sr_addc and the statistics ops) give every floating-point
// result a node that raises when a backward pass reaches it, with what to call instead.
//
// The ops that write into a tensor argument (Tensor(a!) or Tensor(a!)[] in their schemas): the
// in-place quantize_grid_, quantize_block_, quantize_scaled_, sr_add_ and sr_addc_, the
// multi-tensor quantize_grid_many_ and optimizer steps, and the out= ops quantize_grid_out,
// quantize_block_out and quantize_scaled_out. A tensor-list argument counts as each of its tensors.
//
// For a custom op without kernels at the Autograd and ADInplaceOrView keys, the dispatcher's
// defaults run it like a pure function: the written tensor's version counter stays put and a leaf
// that requires grad is overwritten, so a backward that saved the old values silently computes
// with the new ones. The two boxed kernels below do for these ops what torch's generated kernels
// (VariableType, ADInplaceOrView) do for its own in-place and out= ops, with torch's own checks and
// messages. They are C++ because Python kernels at these keys cost about 35 us a call (measured:
// torch.ops.lpsim.quantize_grid_ on 64 floats, 11 us without them, 45 us with them); these two add
// no measurable time (11-12 us both before and after).
//
//   Autograd         With grad mode on: an out= op refuses any argument that requires grad
//                    (torch's out= rule); an in-place op refuses a leaf that requires grad or a
//                    view of one (torch's check_inplace). A written tensor keeps its autograd
//                    history, so the gradient through it is the identity (straight-through, as
//                    quantize's). If another input requires grad (sr_add_'s b), whose gradient the
//                    in-place ops do not compute, the written tensor's history becomes a
//                    NotImplemented node, so that backward raises instead of dropping that
//                    gradient. In forward mode a written tensor keeps its tangent; a tangent on
//                    any other argument, or on an out= op's, is refused (check_forward_ad).
//   ADInplaceOrView  After the kernel ran, bumps the version counter of every written tensor, in
//                    no_grad too (as torch does), so that a backward that saved it raises "one of
//                    the variables needed for gradient computation has been modified by an inplace
//                    operation".
//
// tests/test_torch_integration.py checks that every lpsim op with a Tensor(a!) argument has both
// kernels: a new mutable op must be added to kWritingOps.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/library.h>

#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace lpsim {
namespace {

// How torch holds an autograd node: c10::intrusive_ptr in the torch this project pins,
// std::shared_ptr in older ones (2.11, which GPU machines may have).
using NodePointer = decltype(torch::autograd::Edge::function);

template <class N, class... Args>
NodePointer make_node(Args&&... args) {
  if constexpr (std::is_same_v<NodePointer, std::shared_ptr<torch::autograd::Node>>) {
    return std::make_shared<N>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<N>(std::forward<Args>(args)...);
  }
}

struct StraightThroughOp {
  const char* name;
  size_t inputs;  // the leading arguments that receive the gradient
};
constexpr StraightThroughOp kStraightThroughOps[] = {{"quantize_grid", 1},
                                                     {"quantize_block", 1},
                                                     {"quantize_scaled", 1},
                                                     {"sr_add", 2},
                                                     {"to_container", 1}};

// The ops with no derivative, and what each tells a backward pass that reaches its result.
struct UndifferentiableOp {
  const char* name;
  const char* reason;
};
constexpr UndifferentiableOp kUndifferentiableOps[] = {
    {"mac_matmul",
     "a product under a non-native MAC (lpsim.mac.matmul) has no derivative: "
     "lpsim.nn.functional's products define their first derivatives as products under "
     "input_grad_mac and weight_grad_mac, but those backward products cannot be differentiated "
     "again, so double backward (create_graph=True, then a second differentiation) through them "
     "is not supported; it is with native backward MACs (input_grad_mac=weight_grad_mac="
     "lpsim.MAC()), whose backward products are torch's. Call lpsim.nn.functional.matmul, not "
     "lpsim.mac.matmul, for a simulated product with gradients"},
    {"sum_rounded",
     "a sum under a rounded accumulator (lpsim.accumulate.sum, cumsum) has no derivative"},
    {"dot_rounded",
     "a product under a rounded accumulator (lpsim.accumulate.matvec, matmul) has no derivative; "
     "lpsim.nn.functional's products (under an lpsim.MAC) have gradients"},
    {"sr_addc", "lpsim.update.sr_addcmul and sr_addcdiv have no derivative"},
    {"quantize_grid_statistics",
     "lpsim.statistics.quantize_with_statistics has no derivative; lpsim.quantize has the "
     "straight-through one"},
    {"rounding_statistics", "rounding statistics have no derivative"},
    {"scaled_rounding_statistics", "rounding statistics have no derivative"},
    {"block_rounding_statistics", "rounding statistics have no derivative"},
};

constexpr const char* kWritingOps[] = {
    "quantize_grid_",      "quantize_grid_out",   "quantize_block_", "quantize_block_out",
    "quantize_scaled_",    "quantize_scaled_out", "sr_add_",         "sr_addc_",
    "quantize_grid_many_", "optim_step_"};

// The backward of a straight-through op: the incoming gradient, in each input's dtype.
struct StraightThrough : public torch::autograd::Node {
  StraightThrough(std::string name, std::vector<at::ScalarType> dtypes)
      : name_(std::move(name)), dtypes_(std::move(dtypes)) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    torch::autograd::variable_list out;
    for (const at::ScalarType dtype : dtypes_) {
      out.push_back(grads[0].defined() ? grads[0].to(dtype) : at::Tensor());
    }
    return out;
  }
  std::string name() const override { return name_; }

 private:
  std::string name_;
  std::vector<at::ScalarType> dtypes_;
};

// The result is the op's only output.
template <size_t inputs>
void straight_through_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                             torch::jit::Stack* stack) {
  namespace ag = torch::autograd;
  const size_t first = stack->size() - op.schema().arguments().size();
  std::vector<at::Tensor> differentiable;
  bool requires_grad = false;
  for (size_t i = 0; i < inputs; ++i) {
    differentiable.push_back((*stack)[first + i].toTensor());
    requires_grad = requires_grad || differentiable.back().requires_grad();
  }
  requires_grad = requires_grad && ag::GradMode::is_enabled();
  // Forward mode (torch.autograd.forward_ad, torch.func.jvp, jacfwd, hessian): the result's
  // tangent is the sum of the inputs' tangents, the derivative of the straight-through op.
  // Level 0 is the current level (torch.func maps its own levels onto it, as for torch's ops).
  at::Tensor tangent;
  for (const at::Tensor& t : differentiable) {
    const at::Tensor& t_tangent = t._fw_grad(/*level=*/0);
    if (t_tangent.defined()) tangent = tangent.defined() ? at::add(tangent, t_tangent) : t_tangent;
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
  }
  if (tangent.defined()) {
    const at::Tensor& result = stack->back().toTensor();
    // A broadcast operand's tangent (sr_add's b) is broadcast as the operand was.
    result._set_fw_grad(tangent.to(result.scalar_type()).expand(result.sizes()), /*level=*/0,
                        /*is_inplace_op=*/false);
  }
  if (requires_grad) {
    std::vector<at::ScalarType> dtypes;
    for (const at::Tensor& t : differentiable) dtypes.push_back(t.scalar_type());
    NodePointer node = make_node<StraightThrough>(op.schema().name() + "_backward", dtypes);
    node->set_next_edges(ag::collect_next_edges(differentiable));
    ag::set_history(stack->back().toTensor(), node);
  }
}

// The tensors an argument holds: itself, the tensors of a list, or none.
std::vector<at::Tensor> tensors_of(const c10::IValue& value) {
  if (value.isTensor()) return {value.toTensor()};
  if (value.isTensorList()) return value.toTensorVector();
  return {};
}

// The backward of an op with no derivative: raises.
struct Undifferentiable : public torch::autograd::Node {
  Undifferentiable(std::string name, std::string reason)
      : name_(std::move(name)), reason_(std::move(reason)) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&&) override {
    TORCH_CHECK(false, name_, ": ", reason_);
    return {};
  }
  std::string name() const override { return name_ + "_backward"; }

 private:
  std::string name_;
  std::string reason_;
};

// What a backward or forward pass that reaches the result of an op with no derivative is told.
std::string reason_of(const c10::OperatorHandle& op) {
  for (const UndifferentiableOp& entry : kUndifferentiableOps) {
    if (op.schema().name() == std::string("lpsim::") + entry.name) return entry.reason;
  }
  return "it has no derivative";
}

// Without a kernel here, torch would give the inputs of these ops no gradient (None, or zeros when
// summed with another path) and only warn: with grad mode on and a tensor argument that requires
// grad, every floating-point result gets an Undifferentiable node with an edge to each such
// argument, so that a backward pass that reaches the result raises instead. In forward mode the
// result would get no tangent, a silent zero derivative: an input with a tangent is refused with
// torch's NotImplementedError for ops without a forward derivative.
void undifferentiable_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                             torch::jit::Stack* stack) {
  namespace ag = torch::autograd;
  const size_t arguments = op.schema().arguments().size();
  const size_t first = stack->size() - arguments;
  const bool grad_mode = ag::GradMode::is_enabled();
  std::vector<at::Tensor> inputs;
  for (size_t i = first; i < stack->size(); ++i) {
    for (const at::Tensor& tensor : tensors_of((*stack)[i])) {
      TORCH_CHECK_NOT_IMPLEMENTED(!tensor._fw_grad(/*level=*/0).defined(),
                                  "Trying to use forward AD with ", op.schema().name(),
                                  " that does not support it: ", reason_of(op));
      if (grad_mode && tensor.requires_grad()) inputs.push_back(tensor);
    }
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
  }
  if (inputs.empty()) return;
  const size_t results = op.schema().returns().size();
  std::vector<at::Tensor> differentiable;
  for (size_t i = stack->size() - results; i < stack->size(); ++i) {
    for (const at::Tensor& tensor : tensors_of((*stack)[i])) {
      if (ag::isDifferentiableType(tensor.scalar_type())) differentiable.push_back(tensor);
    }
  }
  if (differentiable.empty()) return;
  NodePointer node = make_node<Undifferentiable>(op.schema().name(), reason_of(op));
  node->set_next_edges(ag::collect_next_edges(inputs));
  for (at::Tensor& tensor : differentiable) ag::set_history(tensor, node);
}

bool is_written(const c10::Argument& argument) {
  const c10::AliasInfo* alias = argument.alias_info();
  return alias != nullptr && alias->isWrite();
}

// Forward mode through a writing op: a written tensor keeps its tangent (the identity, as in
// reverse mode), which is the derivative for the in-place roundings; the tangent of any other
// input would be dropped, so it is refused, as is any tangent given to an out= op (torch's rule:
// out= functions do not support forward AD).
void check_forward_ad(const c10::OperatorHandle& op, const torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const size_t first = stack->size() - arguments.size();
  bool out_op = false;
  for (const c10::Argument& argument : arguments) {
    out_op = out_op || (is_written(argument) && argument.kwarg_only());
  }
  for (size_t i = 0; i < arguments.size(); ++i) {
    const bool writes = is_written(arguments[i]);
    for (const at::Tensor& tensor : tensors_of((*stack)[first + i])) {
      if (!tensor._fw_grad(/*level=*/0).defined()) continue;
      TORCH_CHECK_NOT_IMPLEMENTED(!out_op, "Trying to use forward AD with ", op.schema().name(),
                                  " that does not support it because it is an out= function");
      TORCH_CHECK_NOT_IMPLEMENTED(writes, "Trying to use forward AD with ", op.schema().name(),
                                  " that does not support it: the tangent of its argument ",
                                  arguments[i].name(), " would be dropped");
    }
  }
}

void autograd_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                     torch::jit::Stack* stack) {
  namespace ag = torch::autograd;
  NodePointer not_implemented;
  std::vector<at::Tensor> written;
  check_forward_ad(op, stack);
  if (ag::GradMode::is_enabled()) {
    const auto& arguments = op.schema().arguments();
    const size_t first = stack->size() - arguments.size();
    bool out_op = false, any_requires_grad = false, read_requires_grad = false;
    ag::edge_list edges;  // of the inputs that require grad, for a NotImplemented node
    for (size_t i = 0; i < arguments.size(); ++i) {
      const bool writes = is_written(arguments[i]);
      for (const at::Tensor& tensor : tensors_of((*stack)[first + i])) {
        if (writes) {
          written.push_back(tensor);
          out_op = out_op || arguments[i].kwarg_only();  // torch's out= convention
        }
        if (tensor.requires_grad()) {
          any_requires_grad = true;
          read_requires_grad = read_requires_grad || !writes;
          edges.push_back(ag::impl::gradient_edge(tensor));
        }
      }
    }
    if (any_requires_grad) {
      if (out_op) {
        ag::throw_error_out_requires_grad(op.schema().name().c_str());
      }
      for (const at::Tensor& tensor : written) {
        ag::check_inplace(tensor, /*requires_grad=*/true);
      }
    }
    if (read_requires_grad) {
      not_implemented = make_node<ag::NotImplemented>(op.schema().name(), std::move(edges));
    }
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
  }
  if (not_implemented) {
    ag::rebase_history(written, not_implemented);
  }
}

void bump_versions_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                          torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const size_t first = stack->size() - arguments.size();
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < arguments.size(); ++i) {
    if (is_written(arguments[i])) {
      for (const at::Tensor& tensor : tensors_of((*stack)[first + i])) written.push_back(tensor);
    }
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const at::Tensor& tensor : written) {
    torch::autograd::increment_version(tensor);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(lpsim, Autograd, m) {
  for (const StraightThroughOp& op : kStraightThroughOps) {
    m.impl(op.name, op.inputs == 1
                        ? torch::CppFunction::makeFromBoxedFunction<&straight_through_kernel<1>>()
                        : torch::CppFunction::makeFromBoxedFunction<&straight_through_kernel<2>>());
  }
  for (const char* name : kWritingOps) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&autograd_kernel>());
  }
  for (const UndifferentiableOp& op : kUndifferentiableOps) {
    m.impl(op.name, torch::CppFunction::makeFromBoxedFunction<&undifferentiable_kernel>());
  }
}

TORCH_LIBRARY_IMPL(lpsim, ADInplaceOrView, m) {
  for (const char* name : kWritingOps) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&bump_versions_kernel>());
  }
}

}  // namespace lpsim
