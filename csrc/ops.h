// Argument checking shared by the CPU and CUDA op implementations.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include <lpsim/grid_spec.h>

#include "cpu/kernels.h"

namespace lpsim {

cpu::Dtype container_of(const at::Tensor& x);                 // TypeError for other dtypes
int container_man_bits(cpu::Dtype dtype);
GridSpec grid_spec(cpu::Dtype dtype, int64_t keep, int64_t qmin, int64_t emin, bool subnormals,
                   double pos_limit, double neg_limit, bool saturate, bool has_inf,
                   bool unsigned_zero);                       // checked against the container
Rounding rounding_of(int64_t code);
RandomSpec random_spec(int64_t rbits, const at::Tensor& seed, int64_t offset);
void check_block(const at::Tensor& x, int64_t wl, std::optional<int64_t> dim,
                 std::optional<int64_t> block_size);
void check_out(const at::Tensor& x, const at::Tensor& out);

}  // namespace lpsim
