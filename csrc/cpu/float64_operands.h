// Product operands held as float64 values by the faster MAC loops (mac_lanes.cpp,
// tensor_core_loop.cpp): a product of two converted values is exact_product's (the core converts
// and multiplies the same way); bits_of_real (ieee_ops.h) gives a value's word back.
#pragma once

#include <lpsim/container.h>
#include <lpsim/exact_sum.h>
#include <lpsim/ieee_ops.h>

#include <cstdint>
#include <type_traits>

namespace lpsim::cpu {

// An operand as float64: exact for finite values, by the hardware's conversion where there is one
// (float32, and bfloat16 as the top half of a float32; convert_exact cost about 1 ns an element).
// A NaN's payload may differ from convert_exact's: the loops redo whatever meets an Inf or NaN
// operand with the scalar loop, on the operands themselves.
template <class X>
LPSIM_INLINE double as_double(typename X::storage s) {
  if constexpr (std::is_same_v<X, Float32Container>) {
    return real_of(uint32_t(s));
  } else if constexpr (std::is_same_v<X, BFloat16Container>) {
    return real_of(uint32_t(s) << 16);
  } else {
    return real_of(convert_exact<Float64Container, X>(static_cast<typename X::word>(s)));
  }
}

}  // namespace lpsim::cpu
