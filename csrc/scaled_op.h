// What the quantize_scaled ops (scaled_ops.cpp) share with the statistics op of scaled formats
// (statistics_ops.cpp): a scaled format's op arguments, parsed and checked once, and the CPU scan
// of every block's scale.
#pragma once

#include <ATen/core/Tensor.h>
#include <lpsim/scaled.h>

#include <optional>
#include <string>
#include <vector>

#include "checks.h"

namespace lpsim {

// A scaled format's arguments in an op's C++ signature, each followed by a comma: the saturating
// element grid (element_*), the scale format's grid (scale_*: a PowerOfTwo's exponent range, or a
// Float scale's grid), the scale rule's code (ScaleRule), whether there is a tensor scale, the
// element's emax, precision and largest value, and which elements share a scale as (block, axis):
//   block [n], axis d      blocks of n consecutive elements along dim d
//   block [], axis d       the whole dim d
//   block [r, c], no axis  tiles of r x c over the last two dims (a 1-D tensor is one row)
//   block [], no axis      the whole tensor
#define LPSIM_SCALED_FORMAT_PARAMS                                                        \
  LPSIM_GRID_PARAMS(element_)                                                             \
  LPSIM_GRID_PARAMS(scale_)                                                               \
  int64_t scale_rule, bool tensor_scale, int64_t element_emax, int64_t element_precision, \
      double element_max, at::IntArrayRef block, std::optional<int64_t> axis,

// The spec of x's scaled format, from the parameters LPSIM_SCALED_FORMAT_PARAMS declares; its
// tensor scale is filled in later (set_tensor_scale), where the format has one.
#define LPSIM_SCALED_FORMAT_SPEC                                                             \
  scaled_spec(x, GridSpec{LPSIM_GRID_VALUES(element_)}, GridSpec{LPSIM_GRID_VALUES(scale_)}, \
              scale_rule, tensor_scale, element_emax, element_precision, element_max)

// Those arguments in schema text, followed by nothing.
inline std::string scaled_format_schema() {
  return grid_schema("element_") + ", " + grid_schema("scale_") +
         ", int scale_rule, bool tensor_scale, int element_emax, int element_precision, "
         "float element_max, int[] block, int? axis";
}

// The checks of (block, axis) that need only x's number of dimensions (a 0-d tensor counts as
// 1-D): shared by scaled_layout and the Meta kernels that torch.compile traces with.
void check_scaled_block(int64_t dims, at::IntArrayRef block, std::optional<int64_t> axis);

// How x's elements share scales (checked).
ScaledLayout scaled_layout(const at::Tensor& x, at::IntArrayRef block, std::optional<int64_t> axis);

// The checked spec of a scaled format for x's container.
ScaledSpec scaled_spec(const at::Tensor& x, const GridSpec& element, const GridSpec& scale,
                       int64_t scale_rule, bool tensor_scale, int64_t element_emax,
                       int64_t element_precision, double element_max);

// CPU: the tensor scale of spec (spec.two_level) from the n elements of the contiguous x.
void set_tensor_scale_cpu(Dtype dtype, const void* x, int64_t n, ScaledSpec& spec);

// CPU: the positions of a group that one task of the scan of block_scales_cpu takes.
int64_t scan_chunk(const ScaledLayout& layout);

// CPU: the scale of every block of the contiguous x (layout.blocks() of them, block_of's order),
// scanned in parallel tasks of scan_chunk(layout) positions of a group. The tensor scale must be
// set.
std::vector<BlockScale> block_scales_cpu(Dtype dtype, const void* x, const ScaledLayout& layout,
                                         const ScaledSpec& spec);

}  // namespace lpsim
