// The statistics bounds of a block of a BlockFloat format (lpsim/statistics.py): a finite x beyond
// the block's largest element magnitude overflowed (it saturated to it), and a BlockFloat has no
// subnormals. The block's grid is block_grid's (lpsim/round.h), from the block's largest finite
// magnitude, as the quantize_block ops find it.
#pragma once

#include "round.h"
#include "rounding_statistics.h"

namespace lpsim {

template <class C>
LPSIM_FN StatisticsBounds block_float_statistics_bounds(typename C::word max_abs, int32_t wl) {
  const Grid<C> g = block_grid<C>(max_abs, wl);
  const double limit =
      static_cast<double>(value_of<C>(static_cast<typename C::storage>(g.pos_limit)));
  return StatisticsBounds{-limit, limit, 0.0};
}

}  // namespace lpsim
