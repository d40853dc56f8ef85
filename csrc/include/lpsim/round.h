// The rounding core: one definition of rounding a container value onto a grid of representable
// numbers, shared by the CPU loops and the CUDA kernels.
//
// Every lpsim format is such a grid. Between consecutive powers of two 2^E <= |x| < 2^(E+1) the
// grid spacing (the quantum) is 2^max(E - keep, qmin):
//   Float(exp, man)   keep = man, qmin = emin - man (the subnormal spacing); without subnormals,
//                     values below 2^emin use the spacing 2^emin, so they round to 0 or 2^emin;
//   Fixed(wl, fl)     keep = the container's precision, qmin = -fl: a constant spacing 2^-fl;
//   BlockFloat(wl)    a Fixed grid per block whose spacing follows the block's largest magnitude.
// Values above the format's largest finite value are rounded as if the exponent were unbounded and
// then handled by the overflow policy. The sign is handled apart: rounding acts on the magnitude,
// and up/down are mapped to toward-zero or away-from-zero by the sign, so no rule flips a sign.
//
// Everything works on the container's bits, never on floating-point arithmetic, so the result is
// the same on any CPU, on CUDA, and for any compiler flags.
#pragma once

#include "config.h"
#include "container.h"
#include "rounding.h"
#include "stochastic.h"

namespace lpsim {

// A format's grid, in the bits of container C. Exponents are container-biased. Every field is what
// the inner loop reads; grid_spec.h and block_grid() build them from the format's description.
template <class C>
struct Grid {
  using word = typename C::word;
  int32_t keep;  // fraction bits kept below the leading one in the normal range, <= man_bits
  int32_t qmin;  // biased exponent of the finest spacing (subnormal spacing, fixed-point step)
  int32_t flush_below;  // without subnormals: values below 2^flush_below round to 0 or to it;
                        // with subnormals: kNoFlush
  word min_positive;    // smallest positive grid value: 2^qmin, or 2^flush_below
  word pos_limit;       // largest positive value (inf_bits: no limit)
  word neg_limit;       // largest magnitude a negative value may have (0: none)
  word pos_overflow;    // what a positive finite overflow becomes unless the rule rounds toward
  word neg_overflow;    //   zero: the limit (saturating formats), Inf, or NaN where there is no Inf
  word pos_inf;         // what +Inf and -Inf inputs become: Inf, the limit, or NaN
  word neg_inf;
  word zero_sign;        // sign bits a zero result keeps: sign_mask, or 0 for formats without -0
  uint32_t code_parity;  // 0x80000000: a lone leading one's parity is its exponent code's (P3109);
                         // 0: it is odd, as the significand 1 is (IEEE 754)
};

// flush_below of a grid with subnormals (below any exponent).
constexpr int32_t kNoFlush = -(1 << 20);

// The random input of the stochastic rules is the element's 32-bit word and random_mask(rbits)
// (stochastic.h): rounding behaves as if x were first truncated to rbits bits below the quantum.
// rbits = 32 (mask = all ones) is the default: stochastic then rounds up with probability
// floor(frac * 2^32) / 2^32, where frac is the discarded fraction of the quantum, and
// stochastic_equal decides inexactness on every discarded bit.

// Bits of 2^q (q biased) in container C; q must be >= 1 - C::man_bits (the smallest subnormal).
template <class C>
LPSIM_FN typename C::word pow2_bits(int32_t q) {
  using W = typename C::word;
  return q >= 1 ? W(q) << C::man_bits : W(1) << (q - 1 + C::man_bits);
}

// select(c, a, b) = c ? a : b, computed with a mask so that gcc cannot turn it back into a branch
// (it does so with ?: in a body this large, and then does not vectorise the loop).
template <class T>
LPSIM_FN T select(bool c, T a, T b) {
  return T(b ^ ((a ^ b) & (T(0) - T(c))));
}

// Minimum and maximum in the form gcc recognises as MIN_EXPR / MAX_EXPR (one vector instruction).
template <class T>
LPSIM_FN T min_of(T a, T b) {
  return b < a ? b : a;
}
template <class T>
LPSIM_FN T max_of(T a, T b) {
  return a < b ? b : a;
}

// Round the container bits u onto grid g by rule R. `random` is the element's 32-bit random word
// (stochastic rules only) and `mask` comes from random_mask(rbits).
//
// round_to_grid is round_with_tail without a tail: see there for values that are not container
// values (exact sums). Both are this one definition, instantiated with and without the tail.
//
// Written for gcc's vectoriser, which this loop body must pass (cpu/quantize.cpp depends on it):
// - every choice is a select() and conditions are combined with the non-short-circuit & and |:
//   ?:, && and || leave branches in the loop;
// - no condition is a single-bit test such as `(v & 1) != 0` or `sign != 0`, which gcc turns into
//   1-bit bool conversions it cannot vectorise; they are written as ordered comparisons;
// - no select depends on a loop-invariant condition (a grid flag): the grid carries the outcome of
//   every such decision per sign instead.
template <Rounding R, class C, bool kTail, class D>
LPSIM_FN typename C::word round_on_grid(typename C::word u, D tail, bool sticky, const Grid<C>& g,
                                        uint32_t random, uint32_t mask) {
  using W = typename C::word;
  constexpr int kMan = C::man_bits;
  constexpr int kBits = C::word_bits;
  constexpr W kHalf = W(1) << (kBits - 1);

  const W sign = u & C::sign_mask;
  const W a = u & C::abs_mask;
  const bool negative = u > C::abs_mask;

  // |x| = sig * 2^(eb - bias - kMan): the significand as an integer, subnormals included (their
  // exponent field is 0 and they share the quantum of eb = 1).
  const int32_t field = static_cast<int32_t>(a >> kMan);
  const int32_t eb = max_of(field, int32_t(1));
  const W sig = (a & C::man_mask) | (W(min_of(field, int32_t(1))) << kMan);

  // The leading one of sig is bit `top` (kMan for normal values, lower for subnormals), so x's
  // biased exponent is `exponent` (<= 0 for subnormals). A format's normal range may reach below
  // the container's (e5m2fnuz in float16): precision is counted from the leading one.
  const int32_t top = top_bit(sig);
  const int32_t exponent = eb + top - kMan;

  // How many low bits of sig lie below the grid's quantum: the quantum is 2^(exponent - keep), or
  // 2^low if coarser. It is >= 0 since the grid's finest spacing is representable in the container.
  const int32_t low = select(exponent < g.flush_below, g.flush_below, g.qmin);
  const int32_t shift = max_of(top - g.keep, low + kMan - eb);

  // `aligned` has the last kept bit of sig at the top and the discarded bits below it, so
  // `discarded` = floor(frac * 2^kBits), frac being the discarded fraction of the quantum (0 for
  // shift = 0). For shift >= kBits the value is below the finest quantum, frac < 2^(kMan+1-kBits)
  // < 1/2, and only the top bits of frac are kept; inexactness is then known from a != 0.
  const int32_t up_shift = kBits - 1 - min_of(shift, int32_t(kBits - 1));
  const int32_t down_shift = min_of(max_of(shift - kBits, int32_t(0)), int32_t(kBits - 1));
  const W aligned = W(sig << up_shift);
  const W discarded_bits = select(shift < kBits, W(aligned << 1), W(sig >> down_shift));
  // Whether the kept value is odd, which ties to even and rounding to odd look at: the last kept
  // bit of sig (0 when nothing is kept, sig < 2^(kMan+1)). Where the leading one is the only kept
  // bit (shift == top; every value at precision 1), that bit is 1 and IEEE 754 calls both
  // neighbours of a tie odd (it then takes the larger magnitude, which going up does). With
  // g.code_parity the parity is instead that of the value's code (P3109, gfloat): the kept value is
  // 2^exponent, whose exponent code is exponent - qmin + 1 counted from the finest spacing. (At
  // precision > 1 a lone leading one is the smallest subnormal, code 1: odd either way.) The
  // parity test is an ordered comparison of the masked bit (see above).
  const bool leading_only = shift == top;
  const bool even_code = ((uint32_t(exponent - g.qmin) << 31) & g.code_parity) > 0x7FFFFFFFu;
  const bool kept_odd = (leading_only & !even_code) | (!leading_only & (aligned >= kHalf));

  // With a tail (see round_with_tail), the discarded fraction continues below the bits of sig: the
  // tail, a fraction of sig's last unit, lies `shift` bits further down. `discarded` is then the
  // fraction truncated to kD bits with every lost bit jammed into its last bit (round to odd): the
  // comparisons with 1/2 and the top 32 bits stay those of the exact fraction, since kD >= 33.
  // Without a tail, D = W and this is the fraction of u itself.
  constexpr int kD = 8 * static_cast<int>(sizeof(D));
  constexpr D kHalfD = D(1) << (kD - 1);
  D discarded;
  bool inexact;
  if constexpr (!kTail) {
    discarded = discarded_bits;
    inexact = (discarded != 0) | ((shift >= kBits) & (a != 0));
  } else {
    static_assert(kD >= 33 && kD >= kBits, "the tail needs at least 33 bits");
    // The tail's bits below bit `shift` fall off (all of them for shift >= kD); they are tested
    // left-aligned, as a shift of the constant mask would not vectorise.
    const int32_t tail_shift = min_of(shift, int32_t(kD - 1));
    const D from_tail = select(shift < kD, D(tail >> tail_shift), D(0));
    const D tail_lost = select(shift < kD, D(D(tail << (kD - 1 - tail_shift)) << 1), tail);
    // For shift >= kBits the value lies below the finest quantum (inexact whatever it is), and the
    // low bits of sig that discarded_bits drops are lost too.
    const bool lost = (tail_lost != 0) | sticky | ((shift >= kBits) & (a != 0));
    discarded = (D(discarded_bits) << (kD - kBits)) | from_tail | D(lost);
    inexact = discarded != 0;
  }
  const uint32_t frac32 = static_cast<uint32_t>(discarded >> (kD - 32));

  // Below the finest quantum (shift > kMan) the value lies strictly between 0 and min_positive.
  const bool tiny = shift > kMan;
  const int32_t kept_shift = min_of(shift, int32_t(kMan + 1));

  bool up;
  if constexpr (R == Rounding::nearest) {
    up = (discarded > kHalfD) | ((discarded == kHalfD) & kept_odd);
  } else if constexpr (R == Rounding::nearest_away) {
    up = discarded >= kHalfD;
  } else if constexpr (R == Rounding::nearest_zero) {
    up = discarded > kHalfD;
  } else if constexpr (R == Rounding::toward_zero) {
    up = false;
  } else if constexpr (R == Rounding::away) {
    up = inexact;
  } else if constexpr (R == Rounding::up) {
    up = inexact & !negative;
  } else if constexpr (R == Rounding::down) {
    up = inexact & negative;
  } else if constexpr (R == Rounding::odd) {
    up = inexact & !kept_odd;
  } else if constexpr (R == Rounding::stochastic) {
    // The library's one stochastic decision (stochastic.h): P(up) = frac truncated to rbits bits.
    up = stochastic_rounds_up(frac32, random, mask);
  } else {
    static_assert(R == Rounding::stochastic_equal, "unhandled rounding rule");
    // Moves when inexact after truncation to rbits bits. The sticky bit (any discarded bit at all)
    // sits at bit 0, which only the default mask (rbits = 32) keeps: then every bit decides.
    const bool moves = ((frac32 | uint32_t(inexact)) & mask) != 0;
    up = moves & (random > 0x7FFFFFFFu);
  }

  // On the grid: the kept bits plus the increment, carrying into the exponent field when the
  // significand overflows (which is the next binade's first value).
  const W kept = W(((a >> kept_shift) + W(up)) << kept_shift);
  W mag = select(tiny, select(up, g.min_positive, W(0)), kept);

  // Overflow. Rules that round toward zero keep the largest finite value, as in IEEE 754.
  const W limit = select(negative, g.neg_limit, g.pos_limit);
  const W unclamped = select(negative, g.neg_overflow, g.pos_overflow);
  W overflow;
  if constexpr (R == Rounding::toward_zero || R == Rounding::odd) {
    overflow = limit;
  } else if constexpr (R == Rounding::up) {
    overflow = select(negative, limit, unclamped);
  } else if constexpr (R == Rounding::down) {
    overflow = select(negative, unclamped, limit);
  } else {
    overflow = unclamped;
  }
  mag = select(mag > limit, overflow, mag);

  if constexpr (kTail) {
    // round_with_tail's magnitude inf_bits stands for a finite value beyond the container's range.
    return select(mag == 0, W(sign & g.zero_sign), sign) | mag;
  } else {
    // Inf stays Inf where the format has it; NaN stays the same NaN.
    mag = select(a == C::inf_bits, select(negative, g.neg_inf, g.pos_inf), mag);
    const W out = select(mag == 0, W(sign & g.zero_sign), sign) | mag;
    return select(a > C::inf_bits, u, out);
  }
}

template <Rounding R, class C>
LPSIM_FN typename C::word round_to_grid(typename C::word u, const Grid<C>& g, uint32_t random,
                                        uint32_t mask) {
  return round_on_grid<R, C, false, typename C::word>(u, 0, false, g, random, mask);
}

// The shortcuts: round to nearest (ties to even) and stochastic rounding by shorter forms of
// round_to_grid by a rule chosen at run time, for kernels that round several tensors each by its
// own rule (the CUDA optimizer step): one switch, whose branch is the same for every element.
template <class C>
LPSIM_FN typename C::word round_to_grid_by_rule(Rounding rule, typename C::word u, const Grid<C>& g,
                                                uint32_t random, uint32_t mask) {
  switch (rule) {
    case Rounding::nearest:
      return round_to_grid<Rounding::nearest, C>(u, g, random, mask);
    case Rounding::nearest_away:
      return round_to_grid<Rounding::nearest_away, C>(u, g, random, mask);
    case Rounding::nearest_zero:
      return round_to_grid<Rounding::nearest_zero, C>(u, g, random, mask);
    case Rounding::toward_zero:
      return round_to_grid<Rounding::toward_zero, C>(u, g, random, mask);
    case Rounding::away:
      return round_to_grid<Rounding::away, C>(u, g, random, mask);
    case Rounding::up:
      return round_to_grid<Rounding::up, C>(u, g, random, mask);
    case Rounding::down:
      return round_to_grid<Rounding::down, C>(u, g, random, mask);
    case Rounding::odd:
      return round_to_grid<Rounding::odd, C>(u, g, random, mask);
    case Rounding::stochastic:
      return round_to_grid<Rounding::stochastic, C>(u, g, random, mask);
    case Rounding::stochastic_equal:
    default:
      return round_to_grid<Rounding::stochastic_equal, C>(u, g, random, mask);
  }
}

// mag, the rounded magnitude of a value of sign `negative`, or the grid's overflow outcome of that
// sign where mag passes the grid's limit of that sign: the overflow step of round to nearest and
// stochastic rounding (whose outcome does not depend on the direction), which the shortcuts below
// and in_range.h's bounded form share.
template <class C>
LPSIM_FN typename C::word limited_magnitude(typename C::word mag, bool negative, const Grid<C>& g) {
  using W = typename C::word;
  const W limit = select(negative, g.neg_limit, g.pos_limit);
  return select(mag > limit, select(negative, g.neg_overflow, g.pos_overflow), mag);
}

// round_to_grid, for the grids where shortcut_applies (subnormals, IEEE parity, fewer kept bits
// than the container: the Float formats with subnormals). They give round_to_grid's bits for every
// input (and random word and mask): tests/cpp/round_shortcuts_check.cpp compares them on every
// bfloat16 and float16 value and on samples of float32 and float64 values (on every float32 value
// by hand), in about half of the vector instructions (the CPU loops run them: 3.3 -> 1.8 ns per
// float32 element rounded to nearest on one core). Container value a with exponent field e has the
// quantum 2^s container units, s = max(kMan - keep, qmin + kMan - max(e, 1)): the precision bound
// or the finest spacing. Since qmin >= 1 - keep, the container's subnormals (e = 0) share the
// quantum of e = 1, so rounding a's bits at bit s rounds the value; a carry out of the fraction
// moves into the exponent field, which is the next binade's first value. Where s > kMan the value
// lies below the finest quantum 2^qmin and rounds to 0 or to it.
template <class C>
LPSIM_FN bool shortcut_applies(const Grid<C>& g) {
  return g.flush_below == kNoFlush && g.code_parity == 0 && g.keep < C::man_bits &&
         g.qmin >= 1 - g.keep && g.qmin >= 2 - C::man_bits;
}

// Round to nearest by the shortcut. At s = kMan a normal value's leading one is the only kept bit,
// odd as in IEEE 754; below the finest quantum the value goes up only above half of it (the tie
// goes to the even 0). `half_min` is pow2_bits(qmin - 1).
template <class C>
LPSIM_FN typename C::word round_nearest_shortcut(typename C::word u, const Grid<C>& g,
                                                 typename C::word half_min) {
  using W = typename C::word;
  constexpr int kMan = C::man_bits;
  const W sign = u & C::sign_mask;
  const W a = u & C::abs_mask;
  const bool negative = u > C::abs_mask;
  const int32_t e = max_of(static_cast<int32_t>(a >> kMan), int32_t(1));
  const int32_t s = max_of(int32_t(kMan - g.keep), g.qmin + kMan - e);
  const int32_t in_binade = min_of(s, int32_t(kMan));
  const W unit = W(1) << in_binade;
  // The last kept bit, tested at the top of the word by an ordered comparison (a single-bit test
  // would stop gcc's vectoriser; see round_on_grid). At s = kMan a normal value keeps only its
  // leading one (odd); a container subnormal keeps 0 (even).
  constexpr W kHalf = W(1) << (C::word_bits - 1);
  const bool odd =
      (W(a << (C::word_bits - 1 - in_binade)) >= kHalf) | ((s >= kMan) & (a > C::man_mask));
  const W rounded = (a + ((unit >> 1) - W(1)) + select(odd, W(1), W(0))) & ~(unit - W(1));
  W mag = select(s > kMan, select(a > half_min, g.min_positive, W(0)), rounded);
  mag = limited_magnitude<C>(mag, negative, g);
  mag = select(a == C::inf_bits, select(negative, g.neg_inf, g.pos_inf), mag);
  const W out = select(mag == 0, W(sign & g.zero_sign), sign) | mag;
  return select(a > C::inf_bits, u, out);
}

// Stochastic rounding (Rounding::stochastic) by the shortcut: the discarded fraction read from the
// significand at the quantum 2^s, as round_on_grid reads it, and the library's one decision
// (stochastic_rounds_up).
template <class C>
LPSIM_FN typename C::word round_stochastic_shortcut(typename C::word u, const Grid<C>& g,
                                                    uint32_t random, uint32_t mask) {
  using W = typename C::word;
  constexpr int kMan = C::man_bits;
  constexpr int kBits = C::word_bits;
  const W sign = u & C::sign_mask;
  const W a = u & C::abs_mask;
  const bool negative = u > C::abs_mask;
  const int32_t field = static_cast<int32_t>(a >> kMan);
  const int32_t s = max_of(int32_t(kMan - g.keep), g.qmin + kMan - max_of(field, int32_t(1)));
  const W sig = (a & C::man_mask) | (W(min_of(field, int32_t(1))) << kMan);
  const int32_t up_shift = kBits - 1 - min_of(s, int32_t(kBits - 1));
  const int32_t down_shift = min_of(max_of(s - kBits, int32_t(0)), int32_t(kBits - 1));
  const W discarded = select(s < kBits, W(W(sig << up_shift) << 1), W(sig >> down_shift));
  const bool up =
      stochastic_rounds_up(static_cast<uint32_t>(discarded >> (kBits - 32)), random, mask);
  const int32_t kept_shift = min_of(s, int32_t(kMan + 1));
  const W kept = W(((a >> kept_shift) + select(up, W(1), W(0))) << kept_shift);
  W mag = select(s > kMan, select(up, g.min_positive, W(0)), kept);
  mag = limited_magnitude<C>(mag, negative, g);
  mag = select(a == C::inf_bits, select(negative, g.neg_inf, g.pos_inf), mag);
  const W out = select(mag == 0, W(sign & g.zero_sign), sign) | mag;
  return select(a > C::inf_bits, u, out);
}

// round_to_grid<R>'s bits, by the shortcut where the caller knows that shortcut_applies(g)
// (kShortcut) and R has one (nearest, stochastic): a loop over many values on one grid decides
// kShortcut once, outside the loop.
template <Rounding R, class C, bool kShortcut>
LPSIM_FN typename C::word round_to_grid_or_shortcut(typename C::word u, const Grid<C>& g,
                                                    uint32_t random, uint32_t mask) {
  if constexpr (kShortcut && R == Rounding::nearest) {
    return round_nearest_shortcut<C>(u, g, pow2_bits<C>(g.qmin - 1));
  } else if constexpr (kShortcut && R == Rounding::stochastic) {
    return round_stochastic_shortcut<C>(u, g, random, mask);
  } else {
    return round_to_grid<R, C>(u, g, random, mask);
  }
}

// Round a value that need not be a container value: x = (-1)^s (|u| + t ulp), where u's magnitude
// is |x| truncated onto the container's grid, ulp is the container's spacing at |u| (2^(e - man)
// in u's binade e), and t in [0, 1) is `tail` / 2^64, plus a sliver below that when `sticky` is set
// (the caller truncated t). Every rule then decides exactly as for x itself: the grid is no finer
// than the container's, so x and u share their binade, their quantum and their truncation onto the
// grid, and the discarded fraction is u's continued by t. u's magnitude must be finite, or inf_bits
// for a finite x beyond the container's range (which every rule then treats as an overflow; |u| =
// Inf or NaN inputs are not accepted here: round them with round_to_grid).
template <Rounding R, class C>
LPSIM_FN typename C::word round_with_tail(typename C::word u, uint64_t tail, bool sticky,
                                          const Grid<C>& g, uint32_t random, uint32_t mask) {
  return round_on_grid<R, C, true, uint64_t>(u, tail, sticky, g, random, mask);
}

// The grid of one block of a BlockFloat(wl) format, from the largest finite magnitude in the block
// (as container bits). The block's shared exponent is that of its largest magnitude, floor(log2);
// elements are wl-bit sign-magnitude integers k, |k| <= 2^(wl-1) - 1, times 2^(exponent - (wl-2)),
// so the largest element uses the top bit. The exponent is raised, if need be, so that the spacing
// stays representable in the container: tiny blocks are then exact. Overflow (rounding up past the
// largest integer) saturates; +/-Inf elements stay, NaN stays NaN, and neither affects the
// exponent.
template <class C>
LPSIM_FN Grid<C> block_grid(typename C::word max_abs, int32_t wl) {
  using W = typename C::word;
  constexpr int kMan = C::man_bits;
  const int32_t floor_exponent = 1 - kMan + (wl - 2);
  int32_t e = static_cast<int32_t>(max_abs >> kMan);
  if (e == 0) e = max_abs != 0 ? leading_bit(max_abs) - kMan + 1 : floor_exponent;
  if (e < floor_exponent) e = floor_exponent;
  const int32_t q = e - (wl - 2);
  const W top = (W(1) << (wl - 1)) - 1;  // the largest element integer
  const W limit =
      e >= 1 ? (W(e) << kMan) | ((top << (kMan - (wl - 2))) & C::man_mask) : top << (q - 1 + kMan);
  Grid<C> g;
  // wl - 2 fraction bits below the leading one, the precision of the block's top binade e. Below
  // e the fixed spacing 2^q is coarser than that precision, and above the limit every input
  // saturates, so every input rounds as with keep = kMan (tests/cpp/round_shortcuts_check.cpp,
  // `blocks`); with this keep the shortcuts and the CPU loops' forms apply to the grid.
  g.keep = wl - 2;
  g.qmin = q;
  g.flush_below = kNoFlush;
  g.min_positive = pow2_bits<C>(q);
  g.pos_limit = g.neg_limit = limit;
  g.pos_overflow = g.neg_overflow = limit;  // saturating
  g.pos_inf = g.neg_inf = C::inf_bits;
  g.zero_sign = C::sign_mask;
  g.code_parity = 0;
  return g;
}

// The largest finite magnitude among the bits u, as container bits (a running maximum). Written
// as a plain maximum of (Inf and NaN read as 0), so that a loop over it is a max reduction, which
// compilers vectorise.
template <class C>
LPSIM_FN typename C::word finite_max_abs(typename C::word running, typename C::word u) {
  const typename C::word a = u & C::abs_mask;
  return max_of(running, select(a < C::inf_bits, a, typename C::word(0)));
}

}  // namespace lpsim
