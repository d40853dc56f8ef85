// A faster CPU loop for tensor-core MACs (lpsim/tensor_core.h): sequential or chunked chains of
// groups, exact products, deterministic rules (the normalisation's and the chunks'), float32,
// bfloat16 or float16 operands. Its results are those of the scalar loop (cpu/accumulate.cpp's
// mac_span, one MacSum per result) bit for bit, for any split of the results into tasks.
//
// Design: a task converts its rows of a and every column of b to float64 once, with each operand's
// alignment exponent (operand_exponent; zero operands marked). A group's largest exponent is then
// an integer maximum over the group, and its sum of truncated terms the float64 sum of
// trunc(product 2^-q), exact by the argument at tensor_core_sums_in_float64: both loops run in
// vectors. A task with an Inf or NaN operand, a group whose incoming value is Inf or NaN, and a
// group whose weights leave float64's normal range take the core's tensor_core_step.
#pragma once

#include <lpsim/grid_spec.h>
#include <lpsim/mac.h>
#include <lpsim/types.h>

#include <cstdint>

namespace lpsim::cpu {

// The results [begin, end) of mac_matmul (same arguments, see accumulate.h), when the MAC is one
// this loop serves; false (nothing written) otherwise, or while the faster loops are switched off
// (set_mac_lanes).
bool mac_matmul_tensor_core(Dtype x_dtype, Rounding rounding, const void* a, const void* b,
                            uint64_t* y, int64_t n, int64_t p, int64_t begin, int64_t end,
                            const MacShape& shape, const GridSpec* product, const GridSpec& acc,
                            const GridSpec& inner);

}  // namespace lpsim::cpu
