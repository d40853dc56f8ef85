// What the quantize_block ops (quantize_ops.cpp) share with the statistics op of BlockFloat formats
// (statistics_ops.cpp): which elements share an exponent, parsed and checked once, and the CPU scan
// of every block's largest finite magnitude.
#pragma once

#include <ATen/core/Tensor.h>
#include <lpsim/scaled.h>
#include <lpsim/types.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "block_layout.h"

namespace lpsim {

// The layout of BlockFloat(wl, dim, block_size) in x, after checking the arguments.
BlockLayout block_layout(const at::Tensor& x, int64_t wl, std::optional<int64_t> dim,
                         std::optional<int64_t> block_size);

// The same blocks as tiles of a ScaledLayout over the n > 0 elements, numbered alike (block_of):
// rows of row_len cut into tiles of 1 x block_size, or the classes as the column tiles, `inner`
// wide, of a matrix of classes * inner columns.
ScaledLayout block_tiles(const BlockLayout& layout, int64_t n);

// CPU: the largest finite magnitude (container bits) of each of the layout's blocks of the n
// contiguous elements of x, in block order.
std::vector<uint64_t> block_max_abs_cpu(Dtype dtype, const void* x, int64_t n,
                                        const BlockLayout& layout);

}  // namespace lpsim
