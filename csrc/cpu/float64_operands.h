// Product operands held as float64 values by the faster MAC loops (mac_lanes.cpp,
// tensor_core_loop.cpp): a product of two converted values is exact_product's (the core converts
// and multiplies the same way).
#pragma once

#include <lpsim/container.h>
#include <lpsim/exact_sum.h>

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
    float f;
    __builtin_memcpy(&f, &s, sizeof f);
    return f;
  } else if constexpr (std::is_same_v<X, BFloat16Container>) {
    const uint32_t u = uint32_t(s) << 16;
    float f;
    __builtin_memcpy(&f, &u, sizeof f);
    return f;
  } else {
    const uint64_t u = convert_exact<Float64Container, X>(static_cast<typename X::word>(s));
    double d;
    __builtin_memcpy(&d, &u, sizeof d);
    return d;
  }
}

LPSIM_INLINE uint64_t bits_of(double d) {
  uint64_t u;
  __builtin_memcpy(&u, &d, sizeof u);
  return u;
}

}  // namespace lpsim::cpu
