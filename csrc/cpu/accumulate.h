// CPU loops of the accumulation ops: recursive sums and dot products rounded after every operation
// (sum, cumsum, dot, matvec, matmul). Plain C++ on raw pointers, like every loop file (loops.h);
// accumulate_ops.cpp checks the tensors and splits the work.
#pragma once

#include <lpsim/grid_spec.h>
#include <lpsim/mac.h>
#include <lpsim/types.h>

#include <cstdint>

namespace lpsim::cpu {

// Recursive summation along the middle axis of x, an (outer, n, inner) array of dtype `x_dtype`,
// for the reductions r in [begin, end) (r = o * inner + j sums x[o, k, j], k = 0 .. n-1): s = x[o,
// 0, j] rounded onto `acc`, then s = x[o, k, j] + s rounded onto `acc` for k = 1, 2, .... Rounding
// k of reduction r takes word 2 (r n + k) of the position-keyed stream. Results are float64 bits:
// y[r], or with `cumulative` every partial sum, y[(o n + k) inner + j].
void sum_rounded(Dtype x_dtype, Rounding rounding, const void* x, uint64_t* y, int64_t n,
                 int64_t inner, int64_t begin, int64_t end, bool cumulative, const GridSpec& acc,
                 const RandomSpec& random);

// Dot products rounded after every operation: for r in [begin, end), r = i p + l, the products
// a[i, k] * b[l, k] (a: m x n, b: p x n, both row-major of dtype `x_dtype`, float32, bfloat16 or
// float16) are formed exactly, rounded onto `mul` when given, and summed as in sum_rounded. Product
// k of reduction r takes word 2 (r n + k) + 1. Results are float64 bits y[r].
void dot_rounded(Dtype x_dtype, Rounding rounding, const void* a, const void* b, uint64_t* y,
                 int64_t n, int64_t p, int64_t begin, int64_t end, const GridSpec* mul,
                 const GridSpec& acc, const RandomSpec& random);

// Matrix products under a MAC (lpsim/mac.h): for r in [begin, end), r = i p + l, the exact products
// a[i, k] * b[l, k] (a: m x n, b: p x n, row-major, float32, bfloat16 or float16) summed by MacSum
// with the rounding grids `product` (nullptr: exact products), `acc` and `inner` (the chunks').
// Results are float64 bits y[r].
void mac_matmul(Dtype x_dtype, Rounding rounding, const void* a, const void* b, uint64_t* y,
                int64_t n, int64_t p, int64_t begin, int64_t end, const MacShape& shape,
                const GridSpec* product, const GridSpec& acc, const GridSpec& inner,
                const RandomSpec& random);

}  // namespace lpsim::cpu
