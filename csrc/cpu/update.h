// CPU loops of the update ops: sums rounded once (sr_add, sr_addcmul, sr_addcdiv). Plain C++ on
// raw pointers, like every loop file (loops.h); update_ops.cpp checks the tensors and splits the
// work.
#pragma once

#include <lpsim/grid_spec.h>
#include <lpsim/types.h>

#include <cstdint>

namespace lpsim::cpu {

// y[i] = x[i] + b[i] computed exactly and rounded once onto `grid`, for i in [begin, end). x and y
// have dtype `a`; b has dtype `b`, which is `a`, float32 or float64. x and y may be the same array.
void add_rounded(Dtype a, Dtype b, Rounding rounding, Randomness randomness, const void* x,
                 const void* bv, void* y, int64_t begin, int64_t end, const GridSpec& grid,
                 const RandomSpec& random);

// y[i] = x[i] + t[i] computed exactly and rounded once onto `grid`, where the term
// t[i] = (value * t1[i]) * t2[i] (divide: (value * t1[i]) / t2[i]) is computed as lpsim/update.h's
// AddcOperands says. t1 and t2 have dtype `t`, which is `a`, float32 or float64.
void addc_rounded(Dtype a, Dtype t, bool divide, double value, Rounding rounding,
                  Randomness randomness, const void* x, const void* t1, const void* t2, void* y,
                  int64_t begin, int64_t end, const GridSpec& grid, const RandomSpec& random);

}  // namespace lpsim::cpu
