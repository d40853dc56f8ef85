// The statistics bounds of a block of a scaled format (lpsim/statistics.py): a block's range is
// that of its decoded values, so a finite x below what the element grid's most negative value
// decodes to, or above what its largest decodes to, overflowed (it saturated to that limit), and
// a nonzero decoded value below what the element format's smallest normal value decodes to, in
// magnitude, is subnormal. Each value is decoded as scaled_element decodes an element (lpsim/
// scaled.h): times the block's scale in the arithmetic, then rounded into the container.
//
// With a Float scale the encoder multiplies by the scale's reciprocal, which is not exactly the
// inverse of the decode factor: an x a little beyond the decoded limit may still scale to at most
// the element's limit, and then nothing saturated. The range then extends to the largest such x.
#pragma once

#include <cmath>

#include "rounding_statistics.h"
#include "scaled.h"

namespace lpsim {

// What element value q decodes to in a finite block with scale b, as a double (exactly).
template <class C>
LPSIM_FN double decoded_value(double q, const BlockScale& b, const ScaledSpec& s,
                              const ElementGrids<C>& g) {
  using T = RealOf<ScaledArithmetic<C>>;
  const T element = static_cast<T>(q);  // an element value: exact in the arithmetic
  if (s.rule == ScaleRule::amax) {
    return real_of(decoded_element<C>(element, static_cast<T>(b.decode), g.own));
  }
  return real_of(decoded_pow2_element<C>(element, b.exponent, g.own));
}

// Whether the encoder keeps the container-C value with bits v (nonnegative) within the element
// value m: its product with `reciprocal`, rounded in the arithmetic as float_scaled_element
// rounds it, is at most m.
template <class C>
LPSIM_FN bool within_element(typename C::word v, double m, RealOf<ScaledArithmetic<C>> reciprocal) {
  using T = RealOf<ScaledArithmetic<C>>;
  return mul_rn(real_of(to_arithmetic<C>(v)), reciprocal) <= static_cast<T>(m);
}

// The largest value of container C, at least `start` (the bits of a nonnegative value of C),
// that the encoder keeps within the element value m >= 0 (within_element). The products grow
// with the value, so the search starts from m / reciprocal (in double, rounded into C), which
// lies within a step or two of the answer however coarse the reciprocal (a subnormal one), and
// steps from there; a zero reciprocal keeps every value within m.
template <class C>
LPSIM_FN typename C::word largest_unsaturated(typename C::word start, double m,
                                              RealOf<ScaledArithmetic<C>> reciprocal,
                                              const Grid<ScaledArithmetic<C>>& own) {
  using K = ScaledArithmetic<C>;
  using T = RealOf<K>;
  using W = typename C::word;
  const double quotient = reciprocal > 0 ? m / static_cast<double>(reciprocal) : INFINITY;
  const T guess = static_cast<T>(quotient);  // +Inf beyond the arithmetic's range
  const auto rounded = round_to_grid<Rounding::nearest, K>(bits_of_real(guess), own, 0, 0);
  W v = from_arithmetic<C>(rounded);  // C's inf_bits beyond C's range
  if (v >= C::inf_bits) v = C::inf_bits - 1;
  while (v > start && !within_element<C>(v, m, reciprocal)) --v;
  while (v + 1 < C::inf_bits && within_element<C>(v + 1, m, reciprocal)) ++v;
  return v > start ? v : start;
}

// The decoded limit of element value m >= 0 in a block with a Float scale, extended to the
// largest x that the encoder did not saturate (see above), as a double.
template <class C>
LPSIM_FN double float_scale_limit(double m, const BlockScale& b, const ElementGrids<C>& g) {
  using T = RealOf<ScaledArithmetic<C>>;
  const auto decoded = decoded_element<C>(static_cast<T>(m), static_cast<T>(b.decode), g.own);
  const typename C::word v =
      largest_unsaturated<C>(from_arithmetic<C>(decoded), m, static_cast<T>(b.reciprocal), g.own);
  return real_of(to_arithmetic<C>(v));
}

// The bounds of a block with scale b. element_smallest_normal: the element format's smallest
// normal value (0: it has no subnormals). A block that holds a NaN or an Inf decodes every element
// to NaN, which the counts take as an overflow of each finite x: no other bound applies.
template <class C>
LPSIM_FN StatisticsBounds block_statistics_bounds(const BlockScale& b, const ScaledSpec& s,
                                                  const ElementGrids<C>& g,
                                                  double element_smallest_normal) {
  if (!b.finite) return StatisticsBounds{-INFINITY, INFINITY, 0.0};
  const double smallest_normal =
      element_smallest_normal > 0 ? decoded_value<C>(element_smallest_normal, b, s, g) : 0.0;
  if (s.rule == ScaleRule::amax) {
    return StatisticsBounds{-float_scale_limit<C>(s.element.neg_limit, b, g),
                            float_scale_limit<C>(s.element.pos_limit, b, g), smallest_normal};
  }
  return StatisticsBounds{-decoded_value<C>(s.element.neg_limit, b, s, g),
                          decoded_value<C>(s.element.pos_limit, b, s, g), smallest_normal};
}

}  // namespace lpsim
