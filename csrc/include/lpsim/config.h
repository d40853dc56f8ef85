// Portability macros shared by the host compiler and nvcc.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define LPSIM_HOST_DEVICE __host__ __device__
#define LPSIM_INLINE __forceinline__
#else
#define LPSIM_HOST_DEVICE
#define LPSIM_INLINE inline __attribute__((always_inline))
#endif

// Every function of the rounding core is inlined into the loop that calls it, on the host and on
// the device, so that a CPU loop can be vectorised and a CUDA kernel keeps everything in registers.
#define LPSIM_FN LPSIM_HOST_DEVICE LPSIM_INLINE

// The exception: a function that chooses among the rounding rules at run time (a switch whose every
// case inlines a whole rounding) stays out of line on the host. The CPU loops instantiated for each
// container and compile-time rule would otherwise inline it ten cases at a time, and took minutes
// to compile; it is called once per step of a scalar chain, where the call costs little. CUDA keeps
// it inline.
#if defined(__CUDACC__)
#define LPSIM_FN_RULE_SWITCH LPSIM_HOST_DEVICE __forceinline__
#else
#define LPSIM_FN_RULE_SWITCH inline __attribute__((noinline))
#endif

namespace lpsim {

// Position of the leading one of a significand below 2^24 (2^53 for the 64-bit overload), read from
// the exponent of its exact conversion to float (double): unlike a bit scan this vectorises
// (vcvtdq2ps) and is one instruction on CUDA. For 0 it returns -127 (-1023).
LPSIM_FN int32_t top_bit(uint32_t significand) {
  const float f = static_cast<float>(static_cast<int32_t>(significand));
#if defined(__CUDA_ARCH__)
  const uint32_t bits = __float_as_uint(f);
#else
  uint32_t bits;
  __builtin_memcpy(&bits, &f, sizeof bits);
#endif
  return static_cast<int32_t>(bits >> 23) - 127;
}

LPSIM_FN int32_t top_bit(uint64_t significand) {
  const double d = static_cast<double>(static_cast<int64_t>(significand));
#if defined(__CUDA_ARCH__)
  const uint64_t bits = static_cast<uint64_t>(__double_as_longlong(d));
#else
  uint64_t bits;
  __builtin_memcpy(&bits, &d, sizeof bits);
#endif
  return static_cast<int32_t>(bits >> 52) - 1023;
}

// Position of the highest set bit of a non-zero word (0 for 1, 31 for 0x80000000).
LPSIM_FN int leading_bit(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return 31 - __clz(x);
#else
  return 31 - __builtin_clz(x);
#endif
}

LPSIM_FN int leading_bit(uint64_t x) {
#if defined(__CUDA_ARCH__)
  return 63 - __clzll(static_cast<long long>(x));
#else
  return 63 - __builtin_clzll(x);
#endif
}

}  // namespace lpsim
