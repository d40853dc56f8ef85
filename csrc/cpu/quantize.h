// CPU loops of the quantize ops over the rounding core (round.h). Plain C++ on raw pointers, like
// every loop file (loops.h); quantize_ops.cpp checks the tensors and splits the work. Every
// function handles one contiguous range of the flattened tensor, indexed by the element's logical
// position i (which also selects its random word), so the result does not depend on how the work
// is split.
#pragma once

#include <lpsim/grid_spec.h>
#include <lpsim/types.h>

#include <cstdint>

namespace lpsim::cpu {

// y[i] = round(x[i]) on a fixed grid, for i in [begin, end). x and y may be the same array.
void quantize_grid(Dtype dtype, Rounding rounding, const void* x, void* y, int64_t begin,
                   int64_t end, const GridSpec& grid, const RandomSpec& random);

// y[k] = round(x[k]) on a fixed grid for k in [0, n), where x and y hold the elements
// [first, first + n) of a tensor: element k draws the random word of element first + k, as
// quantize_grid would for that element. For loops that round values they computed in a buffer (the
// optimizer steps).
void quantize_grid_span(Dtype dtype, Rounding rounding, const void* x, void* y, int64_t first,
                        int64_t n, const GridSpec& grid, const RandomSpec& random);

// Block floating point with shared exponents by class: element i belongs to class (i / inner) %
// classes and uses the block grid of class_max_abs[class] (container bits of that class's largest
// finite magnitude). One class is one exponent for the whole tensor; `dim` blocks use one class per
// index.
void quantize_block_classes(Dtype dtype, Rounding rounding, const void* x, void* y, int64_t begin,
                            int64_t end, int64_t inner, int64_t classes,
                            const uint64_t* class_max_abs, int32_t wl, const RandomSpec& random);

// Running maximum of the finite magnitudes of x[begin, end) per class (see above), into max_abs.
void max_abs_classes(Dtype dtype, const void* x, int64_t begin, int64_t end, int64_t inner,
                     int64_t classes, uint64_t* max_abs);

// Block floating point with blocks of block_size consecutive elements along rows of row_len
// (the last block of a row may be shorter), for the blocks numbered [block_begin, block_end) in
// row-major order: each block's largest magnitude is found and the block rounded in one pass.
void quantize_blocks(Dtype dtype, Rounding rounding, const void* x, void* y, int64_t block_begin,
                     int64_t block_end, int64_t row_len, int64_t block_size, int32_t wl,
                     const RandomSpec& random);

// The largest finite magnitude (container bits) of each of the blocks [block_begin, block_end) of
// quantize_blocks' layout: block b's into block_max[b].
void blocks_max_abs(Dtype dtype, const void* x, int64_t block_begin, int64_t block_end,
                    int64_t row_len, int64_t block_size, uint64_t* block_max);

}  // namespace lpsim::cpu
