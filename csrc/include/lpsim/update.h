// The update ops' choices (sr_add, sr_addc), made once for the CPU loops and the CUDA kernels:
// which container holds the exact sum, how the addcmul / addcdiv term is computed and rounded, and
// which operand bits a value-keyed random word is drawn from. A loop loads element i's two
// operands with AddOperands or AddcOperands, draws its word, and rounds with round_sum_to_grid
// (exact_sum.h).
#pragma once

#include <type_traits>

#include "container.h"
#include "exact_sum.h"
#include "ieee_ops.h"
#include "philox.h"

namespace lpsim {

template <class A, class B>
constexpr bool kEitherIs64 =
    std::is_same_v<A, Float64Container> || std::is_same_v<B, Float64Container>;

// The container an exact sum of an A value and a B value is computed in: one that holds both
// (B is A, float32 or float64). A itself when B is A; float64 when either is; float32 otherwise
// (bfloat16 or float16 with float32).
template <class A, class B>
using SumContainer =
    std::conditional_t<std::is_same_v<A, B>, A,
                       std::conditional_t<kEitherIs64<A, B>, Float64Container, Float32Container>>;

// The precision an addcmul / addcdiv term of t1 and t2 (container T) added to an A value is
// computed in, as torch computes it: float64 if A or T is float64, else float32 (torch's addcmul
// and addcdiv compute the 16-bit types in float32).
template <class A, class T>
using TermPrecision = std::conditional_t<kEitherIs64<A, T>, Float64Container, Float32Container>;

// The container of the term and of the exact sum: the term's precision, except for an addcmul term
// computed in float32, whose last product is held exactly in float64 (the product of two float32
// values fits float64's significand), as torch's fused multiply-add holds it.
template <class A, class T, bool kDivide>
using TermContainer =
    std::conditional_t<kDivide || kEitherIs64<A, T>, TermPrecision<A, T>, Float64Container>;

// Operands of sr_add: x[i] and b[i] as words of K = SumContainer<A, B>.
template <class A, class B, class K>
struct AddOperands {
  const typename A::storage* x;
  const typename B::storage* b;
  LPSIM_FN void operator()(uint64_t i, typename K::word& ua, typename K::word& ub) const {
    ua = convert_exact<K, A>(static_cast<typename A::word>(x[i]));
    ub = convert_exact<K, B>(static_cast<typename B::word>(b[i]));
  }
};

// Operands of sr_addc: x[i] and the term (value * t1[i]) * t2[i], or (value * t1[i]) / t2[i] with
// kDivide, as words of K = TermContainer<A, TC, kDivide>, in torch's order: value * t1[i] is
// rounded to nearest in the term's precision P, then divided by t2[i] (rounded to nearest in P, as
// torch's addcdiv), or multiplied by it exactly (torch's CPU addcmul fuses this product with the
// addition; in float64 the product is rounded to nearest, as no wider container holds it). The sum
// with x is exact and rounded once by the caller.
template <class A, class TC, bool kDivide>
struct AddcOperands {
  using P = TermPrecision<A, TC>;
  using K = TermContainer<A, TC, kDivide>;
  using T = RealOf<P>;
  const typename A::storage* x;
  const typename TC::storage* t1;
  const typename TC::storage* t2;
  T value;
  LPSIM_FN void operator()(uint64_t i, typename K::word& ua, typename K::word& ub) const {
    const T p = real_of(convert_exact<P, TC>(static_cast<typename TC::word>(t1[i])));
    const T q = real_of(convert_exact<P, TC>(static_cast<typename TC::word>(t2[i])));
    const T scaled = mul_rn(value, p);
    if constexpr (kDivide) {
      ub = bits_of_real(div_rn(scaled, q));
    } else if constexpr (std::is_same_v<K, P>) {
      ub = bits_of_real(mul_rn(scaled, q));
    } else {
      ub = bits_of_real(mul_rn(static_cast<double>(scaled), static_cast<double>(q)));  // exact
    }
    ua = convert_exact<K, A>(static_cast<typename A::word>(x[i]));
  }
};

// The value-keyed word of an update whose operands are ua and ub (words of K): keyed by their
// float64 bits, so that it does not depend on the container the sum is computed in.
template <class K>
LPSIM_FN uint32_t update_value_word(typename K::word ua, typename K::word ub, const ValueKey& key) {
  return value_word(convert_exact<Float64Container, K>(ua), convert_exact<Float64Container, K>(ub),
                    key);
}

}  // namespace lpsim
