// CPU loops of the dyadic ops over the integer core (lpsim/dyadic.h). Plain C++ on raw pointers,
// like every loop file (loops.h); dyadic_ops.cpp checks the tensors, splits the work across
// threads and turns the counts into errors or warnings. Every elementwise loop handles elements
// [begin, end) of the row-major flattened tensor, and element i draws its random word from the
// Philox mapping of lpsim/philox.h, so results do not depend on how the work is split.
#pragma once

#include <lpsim/grid_spec.h>
#include <lpsim/rounding.h>
#include <lpsim/types.h>

#include <cstdint>

namespace lpsim::cpu {

// The per-class shifts of an elementwise op: element i is in class c = (i / inner) % classes and
// uses first[c] and second[c] (a null table: every shift is 0). One class is a per-tensor scale,
// one class per index along a dimension a per-channel scale.
struct ClassShifts {
  const int64_t* first;
  const int64_t* second;
  int64_t classes;
  int64_t inner;
};

// What a loop counts: `flagged` elements clipped or saturated, and `invalid` inputs (a NaN or Inf
// float, a zero divisor), which the op refuses after the loop.
struct DyadicCounts {
  int64_t flagged = 0;
  int64_t invalid = 0;
};

// y[i] = clip(round(v[i] * 2^-first[c]), lo, hi), stored as `out`; clipped[i] says whether the clip
// fired. v has integer type `in`.
DyadicCounts dyadic_requantize(Integer in, const void* v, Integer out, void* y, bool* clipped,
                               int64_t begin, int64_t end, const ClassShifts& shifts, int64_t lo,
                               int64_t hi, Rounding rule, const RandomSpec& random);

// The same from the exact bits of finite floats x (dtype float32 or float64): round(x[i] *
// 2^-first[c]) with first = -scale. A NaN or Inf element gives 0, unclipped, and counts as invalid.
DyadicCounts dyadic_from_float(Dtype in, const void* x, Integer out, void* y, bool* clipped,
                               int64_t begin, int64_t end, const ClassShifts& shifts, int64_t lo,
                               int64_t hi, Rounding rule, const RandomSpec& random);

// z[i] = round(a[i] * 2^-first[c]) +/- round(b[i] * 2^-second[c]) (one of the two shifts is 0, so
// an element uses its word once), saturated to the operands' type.
DyadicCounts dyadic_add(Integer type, const void* a, const void* b, void* z, int64_t begin,
                        int64_t end, const ClassShifts& shifts, bool subtract, Rounding rule,
                        const RandomSpec& random);

// z[i] = round(a[i] * b[i] * 2^-shift), saturated to the operands' type.
DyadicCounts dyadic_mul(Integer type, const void* a, const void* b, void* z, int64_t begin,
                        int64_t end, int64_t shift, Rounding rule, const RandomSpec& random);

// z[i] = round(a[i] * 2^shift / b[i]), saturated; a zero divisor gives 0 and counts as invalid.
DyadicCounts dyadic_div(Integer type, const void* a, const void* b, void* z, int64_t begin,
                        int64_t end, int64_t shift, Rounding rule, const RandomSpec& random);

// The largest |v[i]|, i < n.
uint64_t dyadic_max_magnitude(Integer type, const void* v, int64_t n);

// z[i, j] = sum_k a[i, k] bt[j, k] exactly, for rows i in [row_begin, row_end), saturated to
// [lo, hi] and stored as `out`; returns how many saturated. a is (rows, depth) and bt (cols,
// depth), both row-major of type `in`. `narrow`: every partial sum fits int64 (the caller's bound),
// else the sums run in 128 bits.
int64_t dyadic_matmul(Integer in, const void* a, const void* bt, Integer out, void* z,
                      int64_t row_begin, int64_t row_end, int64_t depth, int64_t cols, int64_t lo,
                      int64_t hi, bool narrow);

}  // namespace lpsim::cpu
