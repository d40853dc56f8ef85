// CPU loops of the stochastic-arithmetic ops: sums rounded once (sr_add, sr_addcmul, sr_addcdiv)
// and recursive sums and dot products rounded after every operation (sum, cumsum, matvec, matmul).
// Plain C++ on raw pointers, like kernels.h; arith_ops.cpp checks the tensors and splits the work.
#pragma once

#include <cstdint>

#include <lpsim/grid_spec.h>

#include "kernels.h"

namespace lpsim::cpu {

// Where the random word of a stochastic rounding comes from.
enum class Randomness : int32_t {
  position = 0,  // Philox keyed by (seed, offset) and the element's row-major position
  value = 1,     // Philox keyed by (seed, offset) and the operands' values (philox.h: value_word)
};

// y[i] = x[i] + b[i] computed exactly and rounded once onto `grid`, for i in [begin, end). x and y
// have dtype `a`; b has dtype `b`, which is `a`, float32 or float64. x and y may be the same array.
void add_rounded(Dtype a, Dtype b, Rounding rounding, Randomness randomness, const void* x,
                 const void* bv, void* y, int64_t begin, int64_t end, const GridSpec& grid,
                 const RandomSpec& random);

// y[i] = x[i] + t[i] computed exactly and rounded once onto `grid`, where the term
// t[i] = value * (t1[i] * t2[i]) (divide: value * (t1[i] / t2[i])) is computed in float64 if `a` or
// `t` is float64 and in float32 otherwise, each operation rounded to nearest. t1 and t2 have dtype
// `t`, which is `a`, float32 or float64.
void addc_rounded(Dtype a, Dtype t, bool divide, double value, Rounding rounding,
                  Randomness randomness, const void* x, const void* t1, const void* t2, void* y,
                  int64_t begin, int64_t end, const GridSpec& grid, const RandomSpec& random);

// Recursive summation along the middle axis of x, an (outer, n, inner) array of dtype `x_dtype`,
// for the reductions r in [begin, end) (r = o * inner + j sums x[o, k, j], k = 0 .. n-1): s = x[o, 0,
// j] rounded onto `acc`, then s = x[o, k, j] + s rounded onto `acc` for k = 1, 2, .... Rounding k of
// reduction r takes word 2 (r n + k) of the position-keyed stream. Results are float64 bits: y[r],
// or with `cumulative` every partial sum, y[(o n + k) inner + j].
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

}  // namespace lpsim::cpu
