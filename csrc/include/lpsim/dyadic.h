// Integer primitives of dyadic arithmetic, where a value is a pair of integers (v, s) meaning
// v * 2^-s. Header-only and host+device like the rest of the core; every function is exact integer
// arithmetic on a signed type T: int64_t, or __int128 where a product or a shifted dividend of
// int64 mantissas needs more than 64 bits. Floating point is never used.
//
// The one decision is how an exact rational x (v / 2^k, or n / d) becomes an integer. With
// q = floor(x) and frac = x - q in [0, 1) -- floor semantics for negative values too, as on two's
// complement, so v mod 2^k is always in [0, 2^k) --
//   down        q: what an arithmetic right shift does;
//   nearest     q + 1 when frac > 1/2, and on a tie (frac = 1/2) when q is odd: ties to even;
//   stochastic  q + [t + U >= 2^rbits] with t = floor(frac * 2^rbits) and U = word >> (32 - rbits),
//               the top rbits bits of the element's 32-bit random word (uniform on 0 .. 2^rbits -
//               1): stochastic.h's decision, the one the float formats use: a non-negative value
//               rounds the same way here and in the equivalent Fixed format under the same word
//               (a negative one need not: Fixed rounds its magnitude, this its two's complement).
// For a right shift by k <= rbits, this is (v mod 2^k) + (word >> (32 - k)) >= 2^k: it is
// SR(v, k) = floor(v / 2^k) + [(v mod 2^k) + U >= 2^k] with U uniform on {0 .. 2^k - 1}, exactly
// unbiased. For k > rbits the discarded bits are truncated to rbits bits before the comparison, so
// P(up) = floor(frac * 2^rbits) / 2^rbits, which is below frac by less than 2^-rbits (as lpsim's
// rbits for the float formats). The same rule rounds a quotient n / d.
#pragma once

#include "config.h"
#include "rounding.h"
#include "stochastic.h"

namespace lpsim::dyadic {

template <class T>
struct UnsignedOf;
template <>
struct UnsignedOf<int64_t> {
  using type = uint64_t;
};
template <>
struct UnsignedOf<__int128> {
  using type = unsigned __int128;
};

template <class T>
constexpr int64_t kBits = 8 * static_cast<int64_t>(sizeof(T));

// floor(v / 2^n) for every n >= 0: an arithmetic shift, and 0 or -1 once n reaches the width.
template <class T>
LPSIM_FN T floor_shift(T v, int64_t n) {
  return n < kBits<T> ? T(v >> n) : T(v < 0 ? -1 : 0);
}

// Whether v mod 2^n (in [0, 2^n)) is not zero, for every n >= 0.
template <class T>
LPSIM_FN bool low_bits_nonzero(T v, int64_t n) {
  using U = typename UnsignedOf<T>::type;
  if (n >= kBits<T>) return v != 0;
  return (static_cast<U>(v) & ((U(1) << n) - U(1))) != 0;
}

// The rounding increment (0 or 1) of x = q + frac for the rule. `half` and `sticky` describe frac
// for nearest (frac >= 1/2, and frac is not exactly 0 or 1/2); `t` is floor(frac * 2^rbits) for
// stochastic.
template <class T>
LPSIM_FN T round_increment(Rounding rule, T q, bool half, bool sticky, T t, uint32_t word,
                           int rbits) {
  if (rule == Rounding::nearest) return T(half && (sticky || (q & 1) != 0));
  if (rule == Rounding::stochastic) {
    // t < 2^rbits, so t's bits moved to the top of 32 are floor(frac * 2^32) truncated to rbits.
    const uint32_t frac32 = static_cast<uint32_t>(t) << (32 - rbits);
    return T(stochastic_rounds_up(frac32, word, random_mask(rbits)));
  }
  return T(0);  // down
}

// v / 2^k rounded to an integer by the rule, k >= 0 (any size). Never overflows: for k >= 1 the
// result lies within [T_min / 2, T_max / 2 + 1].
template <class T>
LPSIM_FN T shift_round(T v, int64_t k, Rounding rule, uint32_t word, int rbits) {
  if (k <= 0) return v;
  const T q = floor_shift(v, k);
  // Bit k-1 of v mod 2^k, read as floor(v / 2^(k-1)) - 2 q; the bits below it decide stickiness.
  const bool half = floor_shift(v, k - 1) != T(q * 2);
  const bool sticky = low_bits_nonzero(v, k - 1);
  T t = 0;
  if (rule == Rounding::stochastic) {
    // t = floor((v mod 2^k) / 2^(k - rbits)): shifted up when k <= rbits, truncated otherwise.
    t = k <= rbits ? T(T(v - T(q << k)) << (rbits - k))
                   : T(floor_shift(v, k - rbits) - T(q << rbits));
  }
  return q + round_increment(rule, q, half, sticky, t, word, rbits);
}

// n / d rounded to an integer by the rule, d != 0. T must hold n, -n, 2 d and d << rbits: the
// callers use int64_t for int32 operands and __int128 for int64 operands.
template <class T>
LPSIM_FN T divide_round(T n, T d, Rounding rule, uint32_t word, int rbits) {
  if (d < 0) {
    n = -n;
    d = -d;
  }
  T q = n / d;  // truncated toward zero; made a floor below
  T r = n % d;
  if (r < 0) {
    q -= 1;
    r += d;
  }
  const bool half = 2 * r >= d;
  const bool sticky = 2 * r != d && r != 0;
  const T t = rule == Rounding::stochastic ? T((r << rbits) / d) : T(0);
  return q + round_increment(rule, q, half, sticky, t, word, rbits);
}

// v * 2^-k rounded by the rule (a left shift by -k when k < 0, exact) and clipped to [lo, hi]
// (lo <= 0 <= hi). `clipped` tells whether the clip fired. Any k; never overflows.
LPSIM_FN int64_t requantize_value(int64_t v, int64_t k, int64_t lo, int64_t hi, Rounding rule,
                                  uint32_t word, int rbits, bool& clipped) {
  if (k >= 0) {
    const int64_t r = shift_round<int64_t>(v, k, rule, word, rbits);
    clipped = r < lo || r > hi;
    return r < lo ? lo : (r > hi ? hi : r);
  }
  const int64_t m = -k;
  clipped = false;
  if (v == 0) return 0;
  // v * 2^m > hi  <=>  v > floor(hi / 2^m);   v * 2^m < lo  <=>  v < ceil(lo / 2^m).
  const int64_t top = floor_shift<int64_t>(hi, m);
  const int64_t bottom = floor_shift<int64_t>(lo, m) + int64_t(low_bits_nonzero<int64_t>(lo, m));
  clipped = v > top || v < bottom;
  if (v > top) return hi;
  if (v < bottom) return lo;
  return static_cast<int64_t>(static_cast<uint64_t>(v) << m);  // exact: lo <= v * 2^m <= hi
}

// Whether x lies in [lo, hi]; saturate() clips it there.
template <class T>
LPSIM_FN bool in_range(T x, int64_t lo, int64_t hi) {
  return x >= T(lo) && x <= T(hi);
}
template <class T>
LPSIM_FN int64_t saturate(T x, int64_t lo, int64_t hi) {
  return x < T(lo) ? lo : (x > T(hi) ? hi : static_cast<int64_t>(x));
}

}  // namespace lpsim::dyadic
