// The statistics bounds of a block of a scaled format (lpsim/statistics.py): a block's range is
// that of its decoded values, so a finite x below what the element grid's most negative value
// decodes to, or above what its largest decodes to, overflowed (it saturated to that limit), and
// a nonzero decoded value below what the element format's smallest normal value decodes to, in
// magnitude, is subnormal. Each value is decoded as scaled_element decodes an element (lpsim/
// scaled.h): times the block's scale in the arithmetic, then rounded into the container.
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
  return StatisticsBounds{-decoded_value<C>(s.element.neg_limit, b, s, g),
                          decoded_value<C>(s.element.pos_limit, b, s, g), smallest_normal};
}

}  // namespace lpsim
