// A faster CPU loop for the commonest MACs (lpsim/mac.h): the sequential sum without Kahan's
// compensation and without a tensor core, any rule, exact or rounded products. Its results are
// those of the scalar loop (cpu/accumulate.cpp's mac_span, one MacSum per result) bit for bit, with
// the same random words, for any split of the results into tasks.
//
// Design: a task's results (a range in row-major order, as the op splits them) are cut into a
// partial first row, whole rows and a partial last row; their columns of b are converted to
// float64 once per task and packed as panels of kLanes columns (K x kLanes), and each block of
// kRows rows of a, converted once, is run against every panel. A tile's kRows * kLanes results are
// lanes: for each term k every lane adds its own product, so the lanes' sequential sums are
// independent and the loop runs across them in vectors. Each result is a pure function of its row,
// its column and its random words, so neither the tiles nor the thread count change any bit.
// - Nearest onto a grid with float32's exponent range and at most 21 kept bits (bfloat16's, any
//   Float(8, m <= 21) with subnormals: nearest_sum.h's make_nearest_bits_grid), exact products,
//   where every product of the tile is an exact float32 value (operands of 24 significant bits
//   between them, as bfloat16 and float16 operands are): the float32 form of nearest_sum.h in AVX2
//   vectors of eight lanes. A tile whose sums leave its range falls to:
// - Nearest onto a grid that lpsim/nearest_sum.h serves, exact products, finite operands: that
//   float64 fast path in AVX2 vectors of four lanes. A tile whose sums overflow the grid falls to:
// - everything else: the core's branch-free round_finite_sum_to_grid (and round_to_grid for the
//   first term and rounded products) per lane; a lane that meets an Inf or NaN is redone by the
//   scalar MacSum, so the rare cases keep the one definition.
#pragma once

#include <lpsim/grid_spec.h>
#include <lpsim/mac.h>
#include <lpsim/types.h>

#include <cstdint>

namespace lpsim::cpu {

// The results [begin, end) of mac_matmul (same arguments, see accumulate.h), when the MAC is one
// this loop serves; false (nothing written) otherwise, or while the loop is switched off.
bool mac_matmul_lanes(Dtype x_dtype, Rounding rounding, const void* a, const void* b, uint64_t* y,
                      int64_t n, int64_t p, int64_t begin, int64_t end, const MacShape& shape,
                      const GridSpec* product, const GridSpec& acc, const RandomSpec& random);

// Switches the faster loops (this lane loop and the tensor-core loop, tensor_core_loop.h) on or off
// for the whole process and returns the previous setting. Tests only (the private op
// lpsim::_mac_lanes): off, every result comes from the scalar loop, which the tests compare the
// faster loops against. They are on at load.
bool set_mac_lanes(bool enabled);
bool mac_lanes_enabled();

// How many tiles the float32 lanes (nearest onto a grid with float32's exponent range, every
// product an exact float32 value) have served since load. Tests only (the private op
// lpsim::_mac_float_tiles): it shows that a test reaches that path.
int64_t mac_float_tiles();

}  // namespace lpsim::cpu
