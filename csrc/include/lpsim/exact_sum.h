// Exact arithmetic on container values, rounded once: the sum a + b of two values of container C,
// computed exactly with integers and rounded onto a format's grid by round_with_tail (round.h), and
// the exact product of two values of a container of at most 26 significand bits, as a float64.
//
// Like the rest of the core, everything here works on the containers' bits with integer
// arithmetic, so that the result does not depend on the floating-point environment (flush-to-zero
// and denormals-are-zero modes, contraction into fused multiply-adds) or on the device. The only
// floating-point operation, in exact_product, is a float64 multiplication of normal operands whose
// product is exact and normal, which no such mode affects.
#pragma once

#include <type_traits>

#include "container.h"
#include "round.h"

namespace lpsim {

// The bits in container To of the value whose bits in container From are u. Widening (To holds
// every value of From) is always exact; narrowing is exact for the values To holds, which is all
// the callers pass (a format's values, in a container the format fits). Inf keeps its sign and any
// NaN becomes To's quiet NaN with u's sign.
template <class To, class From>
LPSIM_FN typename To::word convert_exact(typename From::word u) {
  if constexpr (std::is_same_v<To, From>) {
    return u;
  } else if constexpr (To::exp_bits == From::exp_bits) {
    // One exponent layout (bfloat16 and float32): the fraction is only longer or shorter. A NaN
    // keeps its quiet bit, which is the top fraction bit in both.
    using WT = typename To::word;
    if constexpr (To::man_bits >= From::man_bits) {
      return WT(WT(u) << (To::man_bits - From::man_bits));
    } else {
      return WT(u >> (From::man_bits - To::man_bits));
    }
  } else {
    using WT = typename To::word;
    using WF = typename From::word;
    constexpr int kFromSignBit = From::exp_bits + From::man_bits;
    constexpr int kToSignBit = To::exp_bits + To::man_bits;
    const WT sign = WT((u >> kFromSignBit) & 1) << kToSignBit;
    const WF a = u & From::abs_mask;
    if (a > From::inf_bits) return sign | To::quiet_nan;
    if (a == From::inf_bits) return sign | To::inf_bits;
    if (a == 0) return sign;
    const int32_t field = static_cast<int32_t>(a >> From::man_bits);
    const uint64_t sig = static_cast<uint64_t>(a & From::man_mask) |
                         (static_cast<uint64_t>(field > 0) << From::man_bits);
    const int32_t top = leading_bit(sig);
    // The value lies in [2^e, 2^(e+1)) and is k times To's spacing 2^q there.
    const int32_t e = max_of(field, int32_t(1)) - From::bias - From::man_bits + top;
    const int32_t to_emin = 1 - To::bias;
    const int32_t q = max_of(e, to_emin) - To::man_bits;
    const int32_t s = e - top - q;
    const uint64_t k = s >= 0 ? (s < 64 ? sig << s : 0) : (s > -64 ? sig >> -s : 0);
    // A normal value's field is e + bias and its fraction k - 2^man; a subnormal's field is 0.
    const WT mag = e >= to_emin ? (WT(e + To::bias - 1) << To::man_bits) + WT(k) : WT(k);
    return sign | mag;
  }
}

// An exact sum: x = (-1)^sign (|u| + (tail / 2^64 + sliver) ulp), in round_with_tail's terms. u's
// magnitude is |x| truncated onto the container's grid (inf_bits: |x| is beyond the container's
// range); ulp is the container's spacing at |u|; sticky says that the sliver below tail / 2^64 is
// not zero.
template <class C>
struct ExactSum {
  typename C::word u;
  uint64_t tail;
  bool sticky;
};

// The exact sum of the finite container values ua and ub. An exact zero is +0, or -0 for rule
// `down`, when the operands have opposite signs (IEEE 754's rule), and keeps the operands' sign
// otherwise.
//
// Method: the operand of larger magnitude X has the significand sx (an integer) and the quantum
// 2^qx of its binade; the other operand, Y = sy 2^(qx - d), d >= 0, is split into k + f quanta of
// X: k = floor(sy / 2^d), f the 64 bits of the rest and a sticky bit for any below them. The sum is
// then sx + k + f, or (sx - k - 1) + (1 - f) when subtracting a non-zero f, in quanta of X, which
// is normalised: a carry out of the binade moves one bit of the integer into the fraction;
// cancellation moves fraction bits up (more than one bit of cancellation needs d <= 1, when f has
// at most one bit, so nothing is lost). The normalised integer is the significand of |x| truncated
// to the container's precision and the fraction its tail.
//
// Written like round_on_grid, for the vectoriser: every case is computed and the result chosen
// with select(), shift counts are clamped instead of guarded, and no condition is a one-bit test.
template <Rounding R, class C>
LPSIM_FN ExactSum<C> exact_sum(typename C::word ua, typename C::word ub) {
  using W = typename C::word;
  constexpr int kMan = C::man_bits;
  constexpr int kBits = C::word_bits;
  constexpr int32_t kTopField = (1 << C::exp_bits) - 1;  // the Inf/NaN field
  constexpr W kHidden = W(1) << kMan;

  const W aa = ua & C::abs_mask;
  const W ab = ub & C::abs_mask;
  const bool swap = ab > aa;
  const W ax = select(swap, ab, aa);
  const W ay = select(swap, aa, ab);
  const W sign = select(swap, ub, ua) & C::sign_mask;
  const bool subtract = W(ua ^ ub) > C::abs_mask;  // the signs differ

  const int32_t fx = static_cast<int32_t>(ax >> kMan);
  const int32_t fy = static_cast<int32_t>(ay >> kMan);
  const int32_t ebx = max_of(fx, int32_t(1));
  const int32_t d = ebx - max_of(fy, int32_t(1));
  const W sx = (ax & C::man_mask) | (W(min_of(fx, int32_t(1))) << kMan);
  const W sy = (ay & C::man_mask) | (W(min_of(fy, int32_t(1))) << kMan);

  // Y in quanta of X: k whole ones (0 once d reaches kBits - 1 > kMan) and the fraction f: for
  // d < 64 the bits of sy below bit d, left-aligned (0 for d = 0); for d >= 64 the bits of sy from
  // bit r = d - 64 up, and sticky if any lies below bit r.
  const W k = sy >> min_of(d, int32_t(kBits - 1));
  const uint64_t wide = sy;
  const int32_t r = min_of(max_of(d - 64, int32_t(0)), int32_t(63));
  const bool far = d >= 64;
  const uint64_t below_d = (wide << (63 - min_of(d, int32_t(63)))) << 1;
  const uint64_t below_r = (wide << (63 - r)) << 1;
  const uint64_t f = select(far, uint64_t(wide >> r), below_d);
  const bool sticky0 = far & (below_r != 0);

  // In quanta of X: sx + k + f, or (sx - k - 1) + (1 - f) when subtracting a non-zero f (1 - f is
  // 2^64 - f, less the sliver when sticky: 2^64 - f - 1, still sticky).
  const bool borrow = subtract & ((f != 0) | sticky0);
  const W i0 = select(subtract, W(sx - k - W(borrow)), W(sx + k));
  const uint64_t t0 = select(subtract, uint64_t(uint64_t(0) - f - uint64_t(sticky0)), f);
  const bool zero = (i0 == 0) & (t0 == 0) & !sticky0;

  // A carry out of X's binade (X normal: subnormal sums reach the normal range by themselves).
  const bool carry = i0 >= 2 * kHidden;
  const W i_carry = i0 >> 1;
  const uint64_t t_carry = (t0 >> 1) | (uint64_t(i0) << 63);
  const bool sticky_carry = sticky0 | (uint64_t(t0 << 63) != 0);

  // Cancellation: bring the leading one back to bit kMan, or stop at the subnormal range. top_bit
  // is exact here (i0 < 2^kMan); l is clamped to 1 when there is no cancellation.
  const bool cancel = (i0 < kHidden) & (ebx > 1);
  const int32_t top = max_of(top_bit(i0), int32_t(-1));
  const int32_t l = max_of(min_of(int32_t(kMan) - top, ebx - 1), int32_t(1));  // <= kMan + 1
  const W i_cancel = W(i0 << l) | W(t0 >> (64 - l));
  const uint64_t t_cancel = t0 << l;

  const W i = select(carry, i_carry, select(cancel, i_cancel, i0));
  const uint64_t tail = select(carry, t_carry, select(cancel, t_cancel, t0));
  const int32_t eb = select(carry, ebx + 1, select(cancel, ebx - l, ebx));
  const bool sticky = (carry & sticky_carry) | (!carry & sticky0);
  const bool overflow = eb >= kTopField;

  // A normal value has the field eb and the fraction i - 2^kMan; eb = 1 also covers subnormals.
  const W mag = (W(eb - 1) << kMan) + i;
  const W zero_sign = select(subtract, R == Rounding::down ? C::sign_mask : W(0), sign);
  const W u = select(zero, zero_sign, W(sign | select(overflow, C::inf_bits, mag)));
  const bool plain = !zero & !overflow;
  return ExactSum<C>{u, select(plain, tail, uint64_t(0)), bool(plain & sticky)};
}

// The quiet NaN or signed Inf that IEEE 754 addition gives when an operand is Inf or NaN: a NaN
// operand (quietened), NaN for Inf - Inf, else the infinite operand.
template <class C>
LPSIM_FN typename C::word special_sum(typename C::word ua, typename C::word ub) {
  using W = typename C::word;
  constexpr W kQuiet = W(1) << (C::man_bits - 1);
  const W aa = ua & C::abs_mask;
  const W ab = ub & C::abs_mask;
  if (aa > C::inf_bits) return ua | kQuiet;
  if (ab > C::inf_bits) return ub | kQuiet;
  if ((aa == C::inf_bits) & (ab == C::inf_bits) & (((ua ^ ub) & C::sign_mask) != 0)) {
    return C::quiet_nan;
  }
  return aa == C::inf_bits ? ua : ub;
}

// Whether ua or ub is Inf or NaN.
template <class C>
LPSIM_FN bool has_special(typename C::word ua, typename C::word ub) {
  return ((ua & C::abs_mask) >= C::inf_bits) | ((ub & C::abs_mask) >= C::inf_bits);
}

// The exact sum of the finite ua and ub rounded once onto grid g (see round_sum_to_grid). Free of
// branches, so that a loop over it vectorises; loops call it and then redo the rare elements that
// has_special() finds with round_sum_to_grid.
template <Rounding R, class C>
LPSIM_FN typename C::word round_finite_sum_to_grid(typename C::word ua, typename C::word ub,
                                                   const Grid<C>& g, uint32_t random,
                                                   uint32_t mask) {
  const ExactSum<C> s = exact_sum<R, C>(ua, ub);
  return round_with_tail<R, C>(s.u, s.tail, s.sticky, g, random, mask);
}

// The exact sum ua + ub rounded once onto grid g by rule R (random and mask as for round_to_grid).
// An Inf or NaN operand gives special_sum's result rounded onto the grid (Inf becomes what the
// format makes of Inf); a finite sum beyond the container's range is an overflow of the format.
template <Rounding R, class C>
LPSIM_FN typename C::word round_sum_to_grid(typename C::word ua, typename C::word ub,
                                            const Grid<C>& g, uint32_t random, uint32_t mask) {
  if (has_special<C>(ua, ub)) return round_to_grid<R, C>(special_sum<C>(ua, ub), g, random, mask);
  return round_finite_sum_to_grid<R, C>(ua, ub, g, random, mask);
}

// The exact product of two values of container C, as float64 bits. C's significands have at most
// 26 bits, so the product has at most 52 and its magnitude lies in [2^-298, 2^256] or is 0: a
// normal float64, exact. Inf and NaN follow IEEE 754 (0 * Inf is NaN).
template <class C>
LPSIM_FN uint64_t exact_product(typename C::word ua, typename C::word ub) {
  static_assert(C::man_bits <= 25 && C::exp_bits <= 8, "the product must be exact in float64");
  const uint64_t a = convert_exact<Float64Container, C>(ua);
  const uint64_t b = convert_exact<Float64Container, C>(ub);
  double x, y;
#if defined(__CUDA_ARCH__)
  x = __longlong_as_double(static_cast<long long>(a));
  y = __longlong_as_double(static_cast<long long>(b));
  return static_cast<uint64_t>(__double_as_longlong(__dmul_rn(x, y)));
#else
  __builtin_memcpy(&x, &a, sizeof x);
  __builtin_memcpy(&y, &b, sizeof y);
  const double p = x * y;
  uint64_t bits;
  __builtin_memcpy(&bits, &p, sizeof bits);
  return bits;
#endif
}

}  // namespace lpsim
