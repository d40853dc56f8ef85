// A fast path for the commonest rounding of a MAC: the exact sum s + t of two float64 values
// rounded to nearest (ties to even) onto a format's grid, computed with float64 arithmetic instead
// of the integer exact_sum + round_with_tail of exact_sum.h (about 25 floating-point and integer
// operations that vectorise four to an AVX2 register, against some 150 integer ones). It takes
// finite operands and gives round_sum_to_grid<nearest>'s bits wherever the result does not
// overflow the grid; callers redo the rest (Inf, NaN, overflow) with the core.
// make_nearest_grid says which grids it serves. round_two_sum_to_grid, at the end, serves every
// other rule from the same TwoSum.
//
// Why it is exact:
// 1. TwoSum (Knuth): hi = fl(s + t) and lo = (s - (hi - b')) + (t - b'), b' = hi - s, give
//    s + t = hi + lo exactly, for any finite s and t whose sum does not overflow float64. Here
//    |s| <= 2^900 and |t| <= 2^256 (a product of float32 values), so nothing overflows.
// 2. Round to odd: v = hi, or the neighbour of hi on the side of lo when lo != 0 and hi's last bit
//    is even. Then v = x = s + t when x is a float64 value, and otherwise v is the odd float64
//    value strictly between x's two float64 neighbours. Every point of the format's grid and every
//    midpoint between two such points has at most keep + 2 <= 52 significant bits, so it is an
//    even float64 value (or zero): none lies strictly between x and v, and x and v are on the same
//    side of (or both on) each. Rounding v to nearest onto the grid therefore gives x's rounding.
// 3. Rounding v onto the grid: its quantum is q = max(2^(e - keep), 2^low), e the binade of v (the
//    same as x's: round to odd never crosses a power of two), low = qmin, or flush_below for values
//    below 2^flush_below in formats without subnormals (see round_on_grid). With M = 1.5 * 2^52 q,
//    |v| + M lies in [2^52 q, 2^53 q), where float64's spacing is q, because |v| < 2^51 q (keep <=
//    50); so fl(|v| + M) is |v| rounded to the nearest multiple of q, ties to the even multiple (M
//    is one), and subtracting M is exact. That is round_on_grid's nearest rule: the even multiple
//    has the even last kept bit, and where the leading one is the only kept bit (keep = 0) both
//    give the larger neighbour. The sign is v's; a zero result keeps it (the grid has -0).
// 4. Values stay far from float64's subnormals (every grid spacing is >= 2^-900), so flush-to-zero
//    modes do not matter; the arithmetic must round to nearest, float64's default, and must not be
//    contracted into fused multiply-adds (the CPU build uses -ffp-contract=off; CUDA uses the _rn
//    intrinsics below).
// Overflow is left to the caller: it checks that no result exceeds the grid's limit.
#pragma once

#include <cstdint>

#include "config.h"
#include "container.h"
#include "round.h"

namespace lpsim {

// The constants of the fast path for one grid (in float64; see step 3 above).
struct NearestGrid {
  double scale;            // 1.5 * 2^(52 - keep): 2^e times this is M for normal values
  double floor_magic;      // 1.5 * 2^52 * 2^qmin: M at the finest spacing
  double flush_threshold;  // 2^flush_below without subnormals, else 0
  double flush_magic;      // 1.5 * 2^52 * 2^flush_below (without subnormals)
  double limit;            // the largest magnitude (the grid's limits are symmetric)
};

LPSIM_FN double nearest_double_of(uint64_t u) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(u));
#else
  double d;
  __builtin_memcpy(&d, &u, sizeof d);
  return d;
#endif
}

LPSIM_FN uint64_t nearest_bits_of(double d) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(__double_as_longlong(d));
#else
  uint64_t u;
  __builtin_memcpy(&u, &d, sizeof u);
  return u;
#endif
}

// float64 operations rounded to nearest, never contracted.
// (templates: D is double, or on the CPU a vector of doubles).
template <class D>
LPSIM_FN D add_rn(D a, D b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
template <class D>
LPSIM_FN D sub_rn(D a, D b) {
#if defined(__CUDA_ARCH__)
  return __dsub_rn(a, b);
#else
  return a - b;
#endif
}
template <class D>
LPSIM_FN D mul_rn(D a, D b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

// 2^e for a biased float64 exponent e in [1, 2046].
LPSIM_FN double nearest_pow2(int32_t e) { return nearest_double_of(uint64_t(e) << 52); }

// Whether the fast path serves grid g (of float64 words, as make_grid builds it), and its
// constants. It needs: keep <= 50 (step 2), symmetric limits below 2^900 and spacings above 2^-900
// (steps 1 and 4), a -0 (step 3), and IEEE parity at precision 1 (P3109's code parity differs
// there).
inline bool make_nearest_grid(const Grid<Float64Container>& g, NearestGrid& out) {
  using C = Float64Container;
  const int32_t low = g.flush_below == kNoFlush ? g.qmin : g.flush_below;
  const bool fits = g.keep <= 50 && (g.code_parity == 0 || g.keep >= 1) &&
                    g.zero_sign == C::sign_mask && g.pos_limit == g.neg_limit &&
                    g.pos_limit < (uint64_t(C::bias + 900) << 52) && g.qmin >= C::bias - 900 &&
                    low >= C::bias - 900;
  if (!fits) return false;
  out.scale = 1.5 * nearest_pow2(C::bias + 52 - g.keep);
  out.floor_magic = 1.5 * nearest_pow2(g.qmin + 52);
  out.flush_threshold = g.flush_below == kNoFlush ? 0.0 : nearest_pow2(g.flush_below);
  out.flush_magic = 1.5 * nearest_pow2(low + 52);
  out.limit = nearest_double_of(g.pos_limit);
  return true;
}

// The two functions below are templates over the value type D and its bits U: double and uint64_t
// for one value (CUDA, scalar code), or GCC vector types of either (the CPU lane loop, cpu/
// mac_lanes.cpp: gcc does not vectorise the scalar form across lanes by itself). They use only
// what both support: arithmetic, bitwise operations and comparisons (a vector comparison is a lane
// mask), and nearest_pick for c ? a : b, which a caller's own lane type may overload. Free of
// branches.

template <class M, class T>
LPSIM_FN T nearest_pick(M c, T a, T b) {
  return c ? a : b;
}

// Bits of v in D (same size as U).
template <class D, class U>
LPSIM_FN D nearest_values_of(U v) {
  if constexpr (sizeof(U) == sizeof(uint64_t)) {
    return nearest_double_of(v);
  } else {
    D d;
    __builtin_memcpy(&d, &v, sizeof d);
    return d;
  }
}
template <class U, class D>
LPSIM_FN U nearest_words_of(D d) {
  if constexpr (sizeof(D) == sizeof(double)) {
    return nearest_bits_of(d);
  } else {
    U u;
    __builtin_memcpy(&u, &d, sizeof u);
    return u;
  }
}

// v (float64 bits, finite) rounded to nearest onto the grid, the exponent unbounded: the grid's
// rounding wherever the result is at most g.limit. `top` becomes the largest result magnitude so
// far: the caller checks top <= g.limit once at the end (instead of once per rounding) and rounds
// with the core where it is not. kFlush: the grid has no subnormals (flush_threshold > 0).
template <class D, class U, bool kFlush>
LPSIM_FN U nearest_round(U v, const NearestGrid& g, D& top) {
  using C = Float64Container;
  const D none{};
  const D a = nearest_values_of<D>(U(v & C::abs_mask));
  const D binade = nearest_values_of<D>(U(v & C::inf_bits));  // 2^e, or 0 for v = 0
  D floor = none + g.floor_magic;
  if constexpr (kFlush)
    floor = nearest_pick(a < none + g.flush_threshold, none + g.flush_magic, floor);
  const D scaled = mul_rn(binade, none + g.scale);
  const D magic = nearest_pick(scaled < floor, floor, scaled);
  const D r = sub_rn(add_rn(a, magic), magic);
  top = nearest_pick(top < r, r, top);
  return nearest_words_of<U>(r) | (v & C::sign_mask);
}

// TwoSum (step 1): hi = fl(x + y) and the error lo, x + y = hi + lo exactly.
template <class D>
LPSIM_FN void two_sum(D x, D y, D& hi, D& lo) {
  hi = add_rn(x, y);
  const D back = sub_rn(hi, x);
  lo = add_rn(sub_rn(x, sub_rn(hi, back)), sub_rn(y, back));
}

// Round to odd (step 2) of x + y = hi + lo, TwoSum's pair, on the bits of hi (sign included):
// for lo != 0, hi's odd neighbour toward lo, or hi if it is odd. Toward |hi| + (lo has hi's
// sign): h | 1; toward zero: (h - 1) | 1. kSignBit: the sign bit's index in a word of U (63 for
// float64, 31 for float32).
template <int kSignBit, class D, class U>
LPSIM_FN U round_to_odd_bits(D hi, D lo) {
  const U zero{};
  const U h = nearest_words_of<U>(hi);
  const U inexact = nearest_pick(lo != D{}, U(zero + 1), zero);
  const U toward_zero = U((h ^ nearest_words_of<U>(lo)) >> kSignBit) & inexact;
  return U((h - toward_zero) | inexact);
}

// The exact s + t (float64 bits of finite values within the bounds of step 1) rounded to nearest
// onto the grid: round_sum_to_grid<Rounding::nearest>'s bits where the result is at most g.limit
// (see nearest_round for `top`).
template <class D, class U, bool kFlush>
LPSIM_FN U nearest_sum(U s, U t, const NearestGrid& g, D& top) {
  D hi, lo;
  two_sum(nearest_values_of<D>(s), nearest_values_of<D>(t), hi, lo);
  return nearest_round<D, U, kFlush>(round_to_odd_bits<63, D, U>(hi, lo), g, top);
}

// ---- The same rounding in float32 lanes, for terms that are exact in float32.
//
// Where every term is a float32 value (a product of operands with at most 24 significant bits
// between them, far from float32's range limits: the caller checks) and the accumulator's grid has
// float32's own exponent range with at most 21 kept bits (bfloat16's, or any Float(8, m) with
// subnormals and m <= 21), the sum can run on float32 arithmetic: eight lanes to an AVX2 register
// instead of four. Steps 1 and 2 above hold for float32 as for float64: TwoSum is exact for finite
// operands whose sum does not overflow, and round to odd leaves 24 - (keep + 1) >= 2 spare bits.
// Step 3 is done on the bits: on such a grid every float32 value, subnormals included, is rounded
// at the same bit, shift = 23 - keep, so v's bits (sign included) are rounded to nearest, ties to
// the even multiple, by adding 2^(shift - 1) - 1 and the kept last bit and clearing the shift low
// bits. A carry out of the fraction raises the exponent field (the next binade's first value, on
// the grid) and never reaches the sign: the largest finite value rounds at most to Inf's bits.
// Results beyond the limit are left to the caller, which finds them from the final sums alone: the
// grid's limit is float32's largest value on it (make_nearest_bits_grid checks), so a sum beyond
// it rounds to Inf's bits, and Inf's bits are kept by every later sum: fl(Inf + t) = Inf with a
// NaN error, v is then the largest finite value or Inf's bits plus one, whichever sign the NaN
// has, and both round to Inf's bits. (A finite s + t that overflows float32 gives the same.) A
// final sum with an all-ones exponent field therefore marks a lane that went beyond the limit.
// (A magic-constant rounding, as for float64, would overflow float32 on grids this wide; narrower
// grids such as float16's keep the float64 lanes, where the bit rounding would need a shift per
// lane, measured slower.) The arithmetic must keep float32 subnormals (no flush-to-zero or
// denormals-are-zero mode): the caller checks.
struct NearestBitsGrid {
  uint32_t shift;  // 23 - keep: the discarded bits of every value
};

inline bool make_nearest_bits_grid(const Grid<Float32Container>& g, NearestBitsGrid& out) {
  using C = Float32Container;
  const int32_t shift = C::man_bits - g.keep;
  // The grid's finest spacing is 2^qmin = 2^(1 - bias - keep) of float32's: its subnormals are
  // float32's, spaced as its values of the smallest binade; its limit is the value below Inf.
  const bool fits = g.keep >= 1 && shift >= 2 && g.qmin == 1 - g.keep && g.code_parity == 0 &&
                    g.flush_below == kNoFlush && g.zero_sign == C::sign_mask &&
                    g.pos_limit == g.neg_limit && g.pos_limit == C::inf_bits - (1u << shift);
  if (!fits) return false;
  out.shift = uint32_t(shift);
  return true;
}

// v's bits rounded at g.shift, a tie going up where tie_up is 1 and down where it is 0: v plus
// 2^(shift - 1) - 1 plus tie_up, the shift low bits cleared. U: 32-bit words (uint32_t or a vector
// of them). G: NearestBitsGrid, or a type whose `shift` is a constant.
template <class U, class G = NearestBitsGrid>
LPSIM_FN U round_bits_at_shift(U v, U tie_up, const G& g) {
  const U zero{};
  return (v + (zero + ((1u << (g.shift - 1)) - 1)) + tie_up) & (zero + ~((1u << g.shift) - 1));
}

// The float32 value v (bits: finite, or Inf's bits plus the cases above) rounded to nearest onto
// the grid: a tie goes to v's even kept bits.
template <class U, class G = NearestBitsGrid>
LPSIM_FN U nearest_bits_round(U v, const G& g) {
  return round_bits_at_shift<U>(v, U((v >> g.shift) & 1u), g);
}

// The exact s + t (float32 bits of finite values, or s Inf's bits as above) rounded to nearest onto
// the grid: round_sum_to_grid<Rounding::nearest>'s bits wherever the result is finite. D: float,
// or a vector of floats of U's width.
//
// Round to odd and the rounding are folded into one step on hi's bits h: round_bits_at_shift with
// a tie's direction `bump`. With lo != 0 the result only differs from h's own where h's discarded
// bits d are exactly one half (a tie in h), where x lies beyond the tie toward lo. So bump is h's
// kept last bit where lo = 0 (ties to even, as for v = h) and else 1 where lo points away from
// zero: with d < 1/2 neither bump carries, with d > 1/2 both do, and at d = 1/2 the carry is the
// side lo is on. This is round_to_odd_bits
// followed by nearest_bits_round, case by case (shift >= 2: v's added odd bit is then discarded,
// and h - 1 at d = 0 borrows back what the carry returns), in 10 operations instead of 12; an Inf h
// (with a NaN lo) stays Inf's bits.
template <class D, class U, class G = NearestBitsGrid>
LPSIM_FN U nearest_bits_sum(U s, U t, const G& g) {
  D hi, lo;
  two_sum(nearest_values_of<D>(s), nearest_values_of<D>(t), hi, lo);
  const U zero{};
  const U h = nearest_words_of<U>(hi);
  const U odd = (h >> g.shift) & 1u;
  const U away = U(zero + 1) - U((h ^ nearest_words_of<U>(lo)) >> 31);
  const U bump = nearest_pick(lo == D{}, odd, away);
  return round_bits_at_shift<U>(h, bump, g);
}

// Every rule, from the same TwoSum: the exact s + t (float64 bits of finite values within the
// bounds of step 1) rounded once onto grid g by rule R, which is round_finite_sum_to_grid<R,
// Float64Container>'s result bit for bit whenever two_sum_serves(g, R).
//
// Why it is exact. Let x = s + t = hi + lo (TwoSum), and w the float64 magnitude just below |x|
// or equal to it: |hi| when lo is zero or has hi's sign (|lo| <= half an ulp of hi, so |x| lies in
// [|hi|, the next float64)), and the float64 below |hi| otherwise, whose bits are |hi|'s minus one
// (|x| then lies strictly between them, as it is not a float64 value). So w <= |x| < w + ulp(w),
// with equality exactly when lo = 0: w is |x| truncated onto float64, which is round_with_tail's u,
// and x's tail is a non-zero fraction of ulp(w) exactly when lo != 0. round_with_tail reads the
// tail only through (a) the top 32 bits of the discarded fraction (stochastic rules), (b) its
// comparisons with one half and (c) whether it is zero. With at least 32 discarded bits of w's
// significand for (a), or at least one for (b), those are w's own bits, and the true tail, like a
// tail of 0 with the sticky bit set, lies strictly inside the last discarded unit: every decision
// is the same. two_sum_serves checks the count: 52 - keep discarded bits in float64's normal range,
// more below it (qmin >= 1); limits below 2^900 keep TwoSum within step 1. A zero sum is
// exact_sum's zero: hi is that zero under float64's nearest (+0 for opposite signs, else the
// operands' sign), and rule `down` takes -0 for opposite signs.
inline bool two_sum_serves(const Grid<Float64Container>& g, Rounding rule) {
  const int32_t keep_limit = is_stochastic(rule) ? 52 - 32 : 52 - 1;
  const uint64_t bound = uint64_t(Float64Container::bias + 900) << 52;
  return g.keep <= keep_limit && g.qmin >= 1 && g.pos_limit < bound && g.neg_limit < bound;
}

template <Rounding R>
LPSIM_FN uint64_t round_two_sum_to_grid(uint64_t s, uint64_t t, const Grid<Float64Container>& g,
                                        uint32_t random, uint32_t mask) {
  using C = Float64Container;
  double hi, lo;
  two_sum(nearest_double_of(s), nearest_double_of(t), hi, lo);
  const uint64_t h = nearest_bits_of(hi);
  const bool inexact = lo != 0.0;
  const bool borrow = inexact & ((h ^ nearest_bits_of(lo)) > C::abs_mask);
  uint64_t u = (h & C::sign_mask) | ((h & C::abs_mask) - uint64_t(borrow));
  if constexpr (R == Rounding::down) {
    const bool opposite = (s ^ t) > C::abs_mask;
    u = select((hi == 0.0) & opposite, C::sign_mask, u);
  }
  return round_with_tail<R, C>(u, 0, inexact, g, random, mask);
}

// Stochastic rounding (Rounding::stochastic) in vectors, for the lane loop: the same w as
// round_two_sum_to_grid, then round_on_grid's decision with the shift computed directly. For a
// grid with subnormals and at most 20 kept bits, a w of float64 exponent field E >= 1 discards
// shift = max(52 - keep, qmin + 52 - E) >= 32 bits of its significand: its discarded fraction's top
// 32 bits are bits [shift - 32, shift) of w, it rounds up when stochastic_rounds_up says so, and
// the result is w truncated to a multiple of 2^shift plus 2^shift if up (a carry into the exponent
// field is the next binade's first value), with x's sign; w = 0 gives hi, exact_sum's zero. The
// shortcut holds for shift <= 52; smaller magnitudes (below the grid's finest spacing) and results
// beyond the grid's limit are left to the caller: `range` gathers, per lane, the largest result
// magnitude and whether a shift exceeded 52, which the caller checks once at the end.
struct StochasticGrid {
  uint64_t normal_shift;  // 52 - keep
  int64_t floor_shift;    // qmin + 52: the shift is floor_shift - E below the normal range
  uint64_t limit;         // the largest magnitude (float64 bits; the limits are symmetric)
  uint64_t mask;          // random_mask(rbits)
};

inline bool make_stochastic_grid(const Grid<Float64Container>& g, uint32_t mask,
                                 StochasticGrid& out) {
  using C = Float64Container;
  const uint64_t bound = uint64_t(C::bias + 900) << 52;
  const bool fits = g.keep <= 20 && g.flush_below == kNoFlush && g.qmin >= C::bias - 900 &&
                    g.zero_sign == C::sign_mask && g.pos_limit == g.neg_limit &&
                    g.pos_limit < bound;
  if (!fits) return false;
  out.normal_shift = uint64_t(52 - g.keep);
  out.floor_shift = int64_t(g.qmin) + 52;
  out.limit = g.pos_limit;
  out.mask = mask;
  return true;
}

// The magnitude bits of w (see above) rounded stochastically; `range` as above: the largest result
// magnitude, with bit 63 set in a lane where a shift exceeded 52.
template <class U, class S>
LPSIM_FN U stochastic_magnitude(U w, U random, const StochasticGrid& g, U& range) {
  const U zero{};
  const S field = S(w >> 52);
  const S below = S(zero + g.floor_shift) - field;
  const U shift =
      U(nearest_pick(below > S(zero + g.normal_shift), below, S(zero + g.normal_shift)));
  const U large = U(nearest_pick(shift > 52, U(zero + 1), zero)) & U(w != zero);
  const U clamped = nearest_pick(shift > 52, U(zero + 52), shift);
  const U frac32 = U(w << (64 - clamped)) >> 32;
  const U threshold = U(~random | ~(zero + g.mask)) & U(zero + 0xFFFFFFFFu);
  const U up = nearest_pick(U(frac32 & (zero + g.mask)) > threshold, U(zero + 1), zero);
  const U mag = ((w >> clamped) + up) << clamped;
  range = nearest_pick(mag > range, mag, range) | (large << 63);
  return mag;
}

// The exact s + t (float64 bits of finite values within step 1's bounds) rounded stochastically
// onto the grid with the lane's random word (in the low 32 bits): round_sum_to_grid<stochastic>'s
// bits wherever `range` stays within the limit (see above).
template <class D, class U, class S>
LPSIM_FN U stochastic_sum(U s, U t, U random, const StochasticGrid& g, U& range) {
  using C = Float64Container;
  const U zero{};
  D hi, lo;
  two_sum(nearest_values_of<D>(s), nearest_values_of<D>(t), hi, lo);
  const U h = nearest_words_of<U>(hi);
  const U inexact = nearest_pick(lo != D{}, U(zero + 1), zero);
  const U borrow = U((h ^ nearest_words_of<U>(lo)) >> 63) & inexact;
  const U w = U(h & C::abs_mask) - borrow;
  return (h & C::sign_mask) | stochastic_magnitude<U, S>(w, random, g, range);
}

// The float64 value v (finite) rounded stochastically onto the grid, as round_to_grid<stochastic>.
template <class U, class S>
LPSIM_FN U stochastic_round(U v, U random, const StochasticGrid& g, U& range) {
  using C = Float64Container;
  return (v & C::sign_mask) | stochastic_magnitude<U, S>(U(v & C::abs_mask), random, g, range);
}

}  // namespace lpsim
