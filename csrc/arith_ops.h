// Argument checking of the stochastic-arithmetic ops, shared by their CPU and CUDA implementations.
#pragma once

#include <ATen/core/Tensor.h>

#include <lpsim/grid_spec.h>

#include "cpu/arith.h"

namespace lpsim {

// TypeError / ValueError for codes other than 0 (position) and 1 (value).
cpu::Randomness randomness_of(int64_t code);

// The container of operand `b` (named `name` in messages) of an update of `a`: b must have a's
// shape and device, and a's dtype, float32 or float64.
cpu::Dtype operand_of(const at::Tensor& a, const at::Tensor& b, const char* name);

// The grid of a sum op, checked against `dtype` (the result's container): like grid_spec (ops.h),
// but the precision must be explicit (keep >= 0) and the limits finite, since the sum may be
// computed in a wider container.
GridSpec sum_grid_spec(cpu::Dtype dtype, int64_t keep, int64_t qmin, int64_t emin, bool subnormals,
                       double pos_limit, double neg_limit, bool saturate, bool has_inf,
                       bool unsigned_zero);

}  // namespace lpsim
