// One IEEE 754 operation rounded to nearest, ties to even, the same on the host and the device.
// The host build has no contraction (-ffp-contract=off) and SSE arithmetic; on the device nvcc's
// _rn intrinsics forbid contraction. fma_rn is the fused multiply-add, rounded once. real_of and
// bits_of_real reinterpret a float32 or float64 container's word as the value and back.
#pragma once

#include <cmath>
#include <type_traits>

#include "config.h"
#include "container.h"

namespace lpsim {

// The floating-point type whose bits are K's word (float32 or float64 containers only).
template <class K>
using RealOf = std::conditional_t<std::is_same_v<K, Float64Container>, double, float>;

LPSIM_FN float real_of(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float v;
  __builtin_memcpy(&v, &bits, sizeof v);
  return v;
#endif
}
LPSIM_FN double real_of(uint64_t bits) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(bits));
#else
  double v;
  __builtin_memcpy(&v, &bits, sizeof v);
  return v;
#endif
}
// 2^k as a double, for |k| <= 1022.
LPSIM_FN double pow2_double(int32_t k) { return real_of(uint64_t(k + 1023) << 52); }

LPSIM_FN uint32_t bits_of_real(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t bits;
  __builtin_memcpy(&bits, &v, sizeof bits);
  return bits;
#endif
}
LPSIM_FN uint64_t bits_of_real(double v) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(v));
#else
  uint64_t bits;
  __builtin_memcpy(&bits, &v, sizeof bits);
  return bits;
#endif
}

LPSIM_FN float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
LPSIM_FN double mul_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
LPSIM_FN float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
LPSIM_FN double div_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}
LPSIM_FN float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
LPSIM_FN double add_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
LPSIM_FN float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
LPSIM_FN double sub_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}
LPSIM_FN float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
// -a, IEEE 754's negate: the sign bit flipped, a NaN's included (torch.neg flips it too). Written
// on the bits, because the compiler folds a negated operand into the operation that follows it
// (fma(-a, b, c) becomes vfnmadd, a - b of -a into a negated sum), and those leave a NaN's sign as
// it was.
LPSIM_FN float neg(float a) { return real_of(bits_of_real(a) ^ 0x80000000u); }
// The square root, correctly rounded (torch's CUDA sqrt; on the CPU torch may call MKL's, which is
// not always correctly rounded: see optim_step.h).
LPSIM_FN float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

}  // namespace lpsim
