// The loops that round a contiguous span of a tensor onto one grid, shared by the loop files that
// round (quantize.cpp, statistics.cpp, scaled.cpp). Inline: it is compiled into each entry point's
// clones.
#pragma once

#include <lpsim/in_range.h>
#include <lpsim/philox.h>
#include <lpsim/round.h>

#include <algorithm>

#include "cpu/loops.h"

namespace lpsim::cpu {

// Elements per block of the range tests: 1 KiB of float32, in the L1 cache; one group of random
// words.
constexpr int64_t kRangeBlock = kGroupSize;

// Which form rounds a block (lpsim/in_range.h): by its largest magnitude and smallest range key,
// two reductions that vectorise. The test reads the block once more from the cache before it is
// written, so y may be x.
template <class C>
LPSIM_INLINE Form block_form(const typename C::storage* x, int64_t n, bool ranged,
                             const InRange<C>& r) {
  using W = typename C::word;
  if (!ranged) return Form::shortcut;
  W largest = 0, smallest = ~W(0);
  for (int64_t k = 0; k < n; ++k) {
    const W u = x[k];
    largest = max_of(largest, W(u & C::abs_mask));
    smallest = min_of(smallest, range_key<C>(u, r));
  }
  return form_of<C>(largest, smallest, r);
}

// x[0, n) rounded onto g into y[0, n) by round to nearest or stochastic rounding (R), for a grid
// the core's shortcuts serve: each block of kRangeBlock by the form of lpsim/in_range.h it allows
// (`ranged`: make_in_range(g, r) held), else by the shortcut. words[k] is element k's random word
// (stochastic rounding only). x and y may be the same memory.
template <class C, Rounding R>
LPSIM_INLINE void round_by_forms(const typename C::storage* x, typename C::storage* y,
                                 const uint32_t* words, int64_t n, const Grid<C>& g, bool ranged,
                                 const InRange<C>& r, uint32_t mask) {
  static_assert(R == Rounding::nearest || R == Rounding::stochastic);
  using S = typename C::storage;
  [[maybe_unused]] const typename C::word half_min = pow2_bits<C>(g.qmin - 1);
  for (int64_t k0 = 0; k0 < n; k0 += kRangeBlock) {
    const int64_t m = std::min(kRangeBlock, n - k0);
    const S* xs = x + k0;
    S* ys = y + k0;
    const Form form = block_form<C>(xs, m, ranged, r);
    if constexpr (R == Rounding::nearest) {
      if (form == Form::fixed) {
        for (int64_t k = 0; k < m; ++k) ys[k] = static_cast<S>(round_nearest_at<C>(xs[k], r.shift));
      } else if (form == Form::bounded) {
        for (int64_t k = 0; k < m; ++k) {
          ys[k] = static_cast<S>(bounded<C>(round_nearest_at<C>(xs[k], r.shift), g));
        }
      } else if (form == Form::variable) {
        for (int64_t k = 0; k < m; ++k) {
          ys[k] = static_cast<S>(round_nearest_at<C>(xs[k], in_range_shift<C>(xs[k], r)));
        }
      } else {
        for (int64_t k = 0; k < m; ++k) {
          ys[k] = static_cast<S>(round_nearest_shortcut<C>(xs[k], g, half_min));
        }
      }
    } else {
      const uint32_t* ws = words + k0;
      if (form == Form::fixed) {
        for (int64_t k = 0; k < m; ++k) {
          ys[k] = static_cast<S>(round_stochastic_at<C>(xs[k], r.shift, ws[k], mask));
        }
      } else if (form == Form::bounded) {
        for (int64_t k = 0; k < m; ++k) {
          ys[k] =
              static_cast<S>(bounded<C>(round_stochastic_at<C>(xs[k], r.shift, ws[k], mask), g));
        }
      } else if (form == Form::variable) {
        for (int64_t k = 0; k < m; ++k) {
          ys[k] = static_cast<S>(
              round_stochastic_at<C>(xs[k], in_range_shift<C>(xs[k], r), ws[k], mask));
        }
      } else {
        for (int64_t k = 0; k < m; ++k) {
          ys[k] = static_cast<S>(round_stochastic_shortcut<C>(xs[k], g, ws[k], mask));
        }
      }
    }
  }
}

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
  // Round to nearest and stochastic rounding go by blocks where the core's shortcuts apply
  // (round.h): a block whose inputs all lie in lpsim/in_range.h's ranges takes its forms (float32
  // to bfloat16 nearest 1.8 -> 0.6 ns per element on one core), others the shortcut.
  constexpr bool kForms = R == Rounding::nearest || R == Rounding::stochastic;
  [[maybe_unused]] InRange<C> range{};
  [[maybe_unused]] const bool forms = kForms && shortcut_applies(g);
  [[maybe_unused]] const bool ranged = forms && make_in_range(g, range);
  [[maybe_unused]] const InRange<C> r = range;
  if constexpr (!is_stochastic(R)) {
    if constexpr (kForms) {
      if (forms) {
        round_by_forms<C, R>(x, y, nullptr, n, g, ranged, r, mask);
        return;
      }
    }
    for (int64_t k = 0; k < n; ++k) y[k] = static_cast<S>(round_to_grid<R, C>(x[k], g, 0, 0));
  } else {
    // Random words come in groups: the span's pieces of each group in turn.
    for (int64_t k0 = 0; k0 < n;) {
      const int64_t group = (first + k0) / kGroupSize;
      const int64_t skip = first + k0 - group * kGroupSize;  // element k0's word in the group
      const int64_t k1 = std::min(n, k0 + kGroupSize - skip);
      const uint32_t* words = cache.group(group) + skip;  // words[k - k0]: element k's
      if constexpr (kForms) {
        if (forms) {
          round_by_forms<C, R>(x + k0, y + k0, words, k1 - k0, g, ranged, r, mask);
          k0 = k1;
          continue;
        }
      }
      for (int64_t k = k0; k < k1; ++k) {
        y[k] = static_cast<S>(round_to_grid<R, C>(x[k], g, words[k - k0], mask));
      }
      k0 = k1;
    }
  }
}

}  // namespace lpsim::cpu
