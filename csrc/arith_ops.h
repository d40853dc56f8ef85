// What the CPU and CUDA implementations of the update ops (sr_add, sr_addc and their in-place
// forms) share: argument checks, the description of one update, and the op variants around a
// device's kernel (as ops.h does for the quantize ops).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <lpsim/grid_spec.h>

#include "cpu/arith.h"
#include "ops.h"

namespace lpsim {

// TypeError / ValueError for codes other than 0 (position) and 1 (value).
cpu::Randomness randomness_of(int64_t code);

// The container of operand `b` (named `name` in messages) of an update of `a`: b must have a's
// shape and device, and a's dtype, float32 or float64.
cpu::Dtype operand_of(const at::Tensor& a, const at::Tensor& b, const char* name);

// The grid of a sum op, checked against `dtype` (the result's container): like grid_spec, but the
// precision must be explicit (keep >= 0) and the limits finite, since the sum may be computed in a
// wider container. lpsim.arithmetic.sum_grid makes such grids.
GridSpec sum_grid_spec(cpu::Dtype dtype, int64_t keep, int64_t qmin, int64_t emin, bool subnormals,
                       double pos_limit, double neg_limit, bool saturate, bool has_inf,
                       bool unsigned_zero);

// One update y[i] = round(x[i] + term(i)), i < n, over contiguous arrays on one device: the term is
// b[i] (sr_add) or value * (t1[i] * t2[i]), value * (t1[i] / t2[i]) with `divide` (sr_addc).
struct Update {
  cpu::Dtype a;        // container of x and y
  cpu::Dtype operand;  // container of b, or of t1 and t2
  const void* x;
  void* y;
  int64_t n;
  const void* b;
  const void* t1;
  const void* t2;
  double value;
  bool divide;
  GridSpec grid;
  Rounding rounding;
  RandomSpec random;
  cpu::Randomness randomness;
};

// A device's kernels: run an update whose tensors live on that device.
using UpdateKernel = void (*)(const at::Tensor& a, const Update& update);

#define LPSIM_UPDATE_ARGS                                                                     \
  int64_t keep, int64_t qmin, int64_t emin, bool subnormals, double pos_limit, double neg_limit, \
      bool saturate, bool has_inf, bool unsigned_zero, int64_t rounding, int64_t rbits,       \
      const at::Tensor &seed, int64_t offset, int64_t randomness

// The checked description of an update of `a`, operands not yet filled in.
Update make_update(const at::Tensor& a, const at::Tensor& operand, const char* name, int64_t keep,
                   int64_t qmin, int64_t emin, bool subnormals, double pos_limit,
                   double neg_limit, bool saturate, bool has_inf, bool unsigned_zero,
                   int64_t rounding, int64_t rbits, const at::Tensor& seed, int64_t offset,
                   int64_t randomness);

// dst = a + b rounded (dst may be a): contiguous copies where needed, then the kernel.
template <UpdateKernel kernel>
void add_into(const at::Tensor& a, const at::Tensor& b, const at::Tensor& dst, Update u) {
  const at::Tensor x = a.contiguous(), bc = b.contiguous();
  Destination out(dst);
  u.x = x.const_data_ptr();
  u.y = out.buffer.data_ptr();
  u.n = x.numel();
  u.b = bc.const_data_ptr();
  if (u.n > 0) kernel(a, u);
  out.finish();
}

// dst = a + value * (t1 op t2) rounded (dst may be a).
template <UpdateKernel kernel>
void addc_into(const at::Tensor& a, const at::Tensor& t1, const at::Tensor& t2, double value,
               bool divide, const at::Tensor& dst, Update u) {
  operand_of(a, t2, "tensor2");
  TORCH_CHECK_TYPE(t1.scalar_type() == t2.scalar_type(),
                   "lpsim: tensor1 and tensor2 must have one dtype, got ", t1.scalar_type(),
                   " and ", t2.scalar_type());
  const at::Tensor x = a.contiguous(), c1 = t1.contiguous(), c2 = t2.contiguous();
  Destination out(dst);
  u.x = x.const_data_ptr();
  u.y = out.buffer.data_ptr();
  u.n = x.numel();
  u.t1 = c1.const_data_ptr();
  u.t2 = c2.const_data_ptr();
  u.value = value;
  u.divide = divide;
  if (u.n > 0) kernel(a, u);
  out.finish();
}

#define LPSIM_UPDATE_CALL(operand, label)                                                       \
  make_update(a, operand, label, keep, qmin, emin, subnormals, pos_limit, neg_limit, saturate, \
              has_inf, unsigned_zero, rounding, rbits, seed, offset, randomness)

template <UpdateKernel kernel>
at::Tensor sr_add_op(const at::Tensor& a, const at::Tensor& b, LPSIM_UPDATE_ARGS) {
  at::Tensor y = at::empty_like(a, at::MemoryFormat::Contiguous);
  add_into<kernel>(a, b, y, LPSIM_UPDATE_CALL(b, "b"));
  return y;
}

template <UpdateKernel kernel>
void sr_add_inplace_op(const at::Tensor& a, const at::Tensor& b, LPSIM_UPDATE_ARGS) {
  add_into<kernel>(a, b, a, LPSIM_UPDATE_CALL(b, "b"));
}

template <UpdateKernel kernel>
at::Tensor sr_addc_op(const at::Tensor& a, const at::Tensor& t1, const at::Tensor& t2,
                      double value, bool divide, LPSIM_UPDATE_ARGS) {
  at::Tensor y = at::empty_like(a, at::MemoryFormat::Contiguous);
  addc_into<kernel>(a, t1, t2, value, divide, y, LPSIM_UPDATE_CALL(t1, "tensor1"));
  return y;
}

template <UpdateKernel kernel>
void sr_addc_inplace_op(const at::Tensor& a, const at::Tensor& t1, const at::Tensor& t2,
                        double value, bool divide, LPSIM_UPDATE_ARGS) {
  addc_into<kernel>(a, t1, t2, value, divide, a, LPSIM_UPDATE_CALL(t1, "tensor1"));
}

// Register the four update ops of one dispatch key with its kernels.
template <UpdateKernel add, UpdateKernel addc>
void register_update_ops(torch::Library& m) {
  m.impl("sr_add", sr_add_op<add>);
  m.impl("sr_add_", sr_add_inplace_op<add>);
  m.impl("sr_addc", sr_addc_op<addc>);
  m.impl("sr_addc_", sr_addc_inplace_op<addc>);
}

}  // namespace lpsim
