// The loop that rounds a contiguous span of a tensor onto one grid, shared by the loop files that
// round (quantize.cpp, statistics.cpp). Inline: it is compiled into each entry point's clones.
#pragma once

#include <lpsim/philox.h>
#include <lpsim/round.h>

#include <algorithm>

#include "cpu/loops.h"

namespace lpsim::cpu {

// Round x[0, n) onto one grid into y[0, n), where x and y hold the elements [first, first + n) of
// a tensor: element k draws the random word of element first + k. The loops have no dependence
// between iterations and call the core inline, so the compiler vectorises them (-fopt-info-vec
// reports them).
template <class C, Rounding R>
LPSIM_INLINE void round_span(const typename C::storage* x, typename C::storage* y, int64_t first,
                             int64_t n, const Grid<C>& grid, uint32_t mask, WordCache& cache) {
  using S = typename C::storage;
  // A local copy: y may alias the grid's words as far as the compiler knows, which would force a
  // reload of every field in every iteration and block vectorisation.
  const Grid<C> g = grid;
  // Round to nearest and stochastic rounding take the core's shortcuts where they apply (round.h).
  if constexpr (R == Rounding::nearest) {
    if (shortcut_applies(g)) {
      const typename C::word half_min = pow2_bits<C>(g.qmin - 1);
      for (int64_t k = 0; k < n; ++k)
        y[k] = static_cast<S>(round_nearest_shortcut<C>(x[k], g, half_min));
      return;
    }
  }
  if constexpr (!is_stochastic(R)) {
    for (int64_t k = 0; k < n; ++k) y[k] = static_cast<S>(round_to_grid<R, C>(x[k], g, 0, 0));
  } else {
    for (int64_t k = 0; k < n;) {
      const int64_t group = (first + k) / kGroupSize;
      const int64_t skip = first - group * kGroupSize;  // words[k + skip] is element k's word
      const int64_t stop = std::min(n, kGroupSize - skip);
      const uint32_t* words = cache.group(group);
      if constexpr (R == Rounding::stochastic) {
        if (shortcut_applies(g)) {
          for (; k < stop; ++k) {
            y[k] = static_cast<S>(round_stochastic_shortcut<C>(x[k], g, words[k + skip], mask));
          }
          continue;
        }
      }
      for (; k < stop; ++k) {
        y[k] = static_cast<S>(round_to_grid<R, C>(x[k], g, words[k + skip], mask));
      }
    }
  }
}

}  // namespace lpsim::cpu
