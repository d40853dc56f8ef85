// Rounding where no special case can arise: the magnitudes from a grid's second-smallest binade up
// to its limits (and zero where the grid keeps its sign). There round_nearest_shortcut and
// round_stochastic_shortcut (round.h) reduce to rounding the container bits at one bit s, the
// quantum 2^s container units: no underflow to zero or to the smallest subnormal, no overflow, Inf
// or NaN. Above the grid's subnormals s is fixed, kMan - keep; in its subnormal binades it is
// qmin + kMan - e for a container exponent field e. Finite inputs of the fixed range beyond the
// limits round at the fixed s as if the exponent were unbounded and then take the grid's overflow
// outcome (the bounded form). The CPU loops (cpu/round_span.h) test a block of inputs against the
// ranges and round it by the fixed, variable or bounded form or the shortcut.
// tests/cpp/round_shortcuts_check.cpp compares the forms with round_to_grid on every input they
// serve (every bfloat16 and float16 value, samples of float32 and float64 values).
#pragma once

#include "round.h"
#include "stochastic.h"

namespace lpsim {

template <class C>
struct InRange {
  using word = typename C::word;
  word high;       // the largest magnitude in range: the smaller limit
  word zero_key;   // 1 where the grid keeps the sign of zero (zero is in range), else 0
  word low_key;    // the smallest key (range_key) in range: that of the first magnitude of binade
                   // max(qmin + 1, 1) (a container subnormal's quantum is not its binade's; binade
                   // qmin ends at s = kMan)
  word fixed_key;  // the smallest key where s is fixed: that of binade max(qmin + keep, 1)
  int32_t shift;   // the fixed s, kMan - keep
  int32_t subnormal;  // qmin + kMan: s = subnormal - e below the fixed range
};

// Whether the forms apply to g (a grid the shortcuts serve, keeping at least one fraction bit,
// with a nonempty range), and their constants.
template <class C>
LPSIM_FN bool make_in_range(const Grid<C>& g, InRange<C>& r) {
  using W = typename C::word;
  if (!shortcut_applies(g) || g.keep < 1) return false;
  const int32_t first = max_of(g.qmin + 1, int32_t(1));
  const int32_t fixed = max_of(g.qmin + g.keep, int32_t(1));
  if (fixed >= (1 << C::exp_bits) - 1) return false;
  const W low = W(first) << C::man_bits, fixed_low = W(fixed) << C::man_bits;
  r.high = min_of(g.pos_limit, g.neg_limit);
  if (r.high < fixed_low) return false;  // unsigned grids (no negative values), empty ranges
  r.zero_key = g.zero_sign == C::sign_mask ? W(1) : W(0);
  r.low_key = low - r.zero_key;
  r.fixed_key = fixed_low - r.zero_key;
  r.shift = C::man_bits - g.keep;
  r.subnormal = g.qmin + C::man_bits;
  return true;
}

// Which form rounds a set of inputs (a block of the CPU loops, or one input): the fixed quantum,
// the variable one, the fixed quantum with the grid's limits (`bounded`: finite inputs of the fixed
// range, some of them beyond `high`), or none of them (the shortcut).
enum class Form { fixed, variable, bounded, shortcut };

// The key of container bits u in the range tests: its magnitude less r.zero_key, so that a zero
// in range wraps to the largest word (the smallest key never comes from it) and a zero outside
// the range is the smallest key, below every range's.
template <class C>
LPSIM_FN typename C::word range_key(typename C::word u, const InRange<C>& r) {
  return typename C::word((u & C::abs_mask) - r.zero_key);
}

// The form of a set of inputs whose largest magnitude (container bits without the sign) is
// `largest` and whose smallest range_key is `smallest`: a block is tested by two reductions (a
// maximum and a minimum, which vectorise), not element by element. Inf and NaN lie above high.
template <class C>
LPSIM_FN Form form_of(typename C::word largest, typename C::word smallest, const InRange<C>& r) {
  if (largest > r.high) {
    return largest < C::inf_bits && smallest >= r.fixed_key ? Form::bounded : Form::shortcut;
  }
  if (smallest >= r.fixed_key) return Form::fixed;
  return smallest >= r.low_key ? Form::variable : Form::shortcut;
}

// The quantum's bit s for u in r's range: the fixed s, or the subnormal binades' (at most kMan - 1
// in range; the clamp only keeps shifts defined for the zero).
template <class C>
LPSIM_FN int32_t in_range_shift(typename C::word u, const InRange<C>& r) {
  const int32_t e = static_cast<int32_t>((u & C::abs_mask) >> C::man_bits);
  return min_of(max_of(r.shift, r.subnormal - e), int32_t(C::man_bits - 1));
}

// u rounded to nearest, ties to even, at the quantum 2^s, s in [1, kMan - 1]: the last kept bit is
// bit s, a carry out of the fraction moves into the exponent field (the next binade's first value),
// the result stays within the limits (grid values: rounding to nearest is monotone), and a zero
// stays the signed zero. round_nearest_shortcut's bits for u in range.
template <class C>
LPSIM_FN typename C::word round_nearest_at(typename C::word u, int32_t s) {
  using W = typename C::word;
  const W a = u & C::abs_mask;
  const W unit = W(1) << s;
  return ((a + ((unit >> 1) - W(1)) + ((a >> s) & W(1))) & (W(0) - unit)) | (u & C::sign_mask);
}

// u rounded stochastically (Rounding::stochastic) at the quantum 2^s, s in [1, kMan - 1]: the
// discarded bits, read at the top of a word, decide as everywhere (stochastic_rounds_up); rounding
// up stays within the limits (grid values). round_stochastic_shortcut's bits for u in range.
template <class C>
LPSIM_FN typename C::word round_stochastic_at(typename C::word u, int32_t s, uint32_t random,
                                              uint32_t mask) {
  using W = typename C::word;
  constexpr int kBits = C::word_bits;
  const W a = u & C::abs_mask;
  const uint32_t discarded = static_cast<uint32_t>(W(a << (kBits - s)) >> (kBits - 32));
  const W up = select(stochastic_rounds_up(discarded, random, mask), W(1), W(0));
  return (((a >> s) + up) << s) | (u & C::sign_mask);
}

// The bounded form: `rounded`, a finite input of the fixed range rounded by the fixed form (at
// r.shift: a magnitude in the fixed range, or past the grid's limits, as if the exponent were
// unbounded), replaced by the grid's overflow outcome of its sign where it passes the limit of its
// sign: the shortcuts' last steps for such an input (it is neither zero nor Inf), and so their
// bits.
template <class C>
LPSIM_FN typename C::word bounded(typename C::word rounded, const Grid<C>& g) {
  const bool negative = rounded > C::abs_mask;
  return (rounded & C::sign_mask) | limited_magnitude<C>(rounded & C::abs_mask, negative, g);
}

}  // namespace lpsim
