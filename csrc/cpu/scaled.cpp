// CPU loops of the scaled-format ops (see scaled.h), multiversioned for AVX2 (loops.h).
#include "cpu/scaled.h"

#include <lpsim/philox.h>
#include <lpsim/round.h>
#include <lpsim/scaled.h>

#include <algorithm>

#include "cpu/loops.h"
#include "dispatch.h"

namespace lpsim::cpu {

namespace {

// f(first, n) for each contiguous run of elements of positions [p0, p1) of group g, inner indices
// [i0, i1): a run starts at offset `first` with inner index i0 and holds n elements.
template <class F>
LPSIM_INLINE void for_each_run(const ScaledLayout& l, int64_t g, int64_t p0, int64_t p1, int64_t i0,
                               int64_t i1, F&& f) {
  const GroupTile t = group_tile(l, g);
  const int64_t positions = std::min(p1, t.height * t.width);
  if (i1 - i0 == l.inner) {
    // All inner indices: a tile row's positions are contiguous.
    for (int64_t p = p0; p < positions;) {
      const int64_t row = p / t.width, column = p % t.width;
      const int64_t count = std::min(t.width - column, positions - p);
      f(t.start + (row * l.cols + column) * l.inner, count * l.inner);
      p += count;
    }
  } else {
    for (int64_t p = p0; p < positions; ++p) {
      const int64_t row = p / t.width, column = p % t.width;
      f(t.start + (row * l.cols + column) * l.inner + i0, i1 - i0);
    }
  }
}

template <class C>
LPSIM_INLINE typename C::word magnitude(typename C::storage s) {
  return static_cast<typename C::word>(s) & C::abs_mask;
}

template <class C>
LPSIM_INLINE void max_abs_impl(const void* x, const ScaledLayout& l, int64_t g, int64_t p0,
                               int64_t p1, int64_t i0, int64_t i1, uint64_t* amax) {
  using W = typename C::word;
  const auto* xs = static_cast<const typename C::storage*>(x);
  const int64_t width = i1 - i0;
  for_each_run(l, g, p0, p1, i0, i1, [&](int64_t first, int64_t n) LPSIM_LAMBDA_INLINE {
    if (width == 1) {
      W m = static_cast<W>(amax[0]);
      for (int64_t k = 0; k < n; ++k) m = max_of(m, magnitude<C>(xs[first + k]));
      amax[0] = m;
    } else {
      for (int64_t k = 0; k < n; ++k) {
        uint64_t& m = amax[k % width];
        m = max_of(m, static_cast<uint64_t>(magnitude<C>(xs[first + k])));
      }
    }
  });
}

// Round x[first, first + n) into y with one block scale (elements take the random words of their
// offsets), as quantize.cpp's round_span does for one grid.
template <class C, Rounding R, bool kPowerOfTwo>
LPSIM_INLINE void round_run_one_scale(const typename C::storage* x, typename C::storage* y,
                                      int64_t first, int64_t n, const BlockScale& scale,
                                      const ElementGrids<C>& grids, uint32_t mask,
                                      WordCache& cache) {
  using S = typename C::storage;
  const BlockScale b = scale;
  const ElementGrids<C> g = grids;  // local copies, as in round_span
  if constexpr (!is_stochastic(R)) {
    for (int64_t k = first; k < first + n; ++k) {
      y[k] = static_cast<S>(scaled_element<R, C, kPowerOfTwo>(x[k], b, g, 0, 0));
    }
  } else {
    for (int64_t k = first; k < first + n;) {
      const int64_t group = k / kGroupSize;
      const int64_t stop = std::min(first + n, (group + 1) * kGroupSize);
      const uint32_t* words = cache.group(group);
      const int64_t base = group * kGroupSize;  // words[k - base] is element k's word
      for (; k < stop; ++k) {
        y[k] = static_cast<S>(scaled_element<R, C, kPowerOfTwo>(x[k], b, g, words[k - base], mask));
      }
    }
  }
}

template <class C>
LPSIM_INLINE void round_impl(Rounding rounding, const void* x, void* y, const ScaledLayout& l,
                             int64_t g, int64_t p0, int64_t p1, int64_t i0, int64_t i1,
                             const BlockScale* scales, const ScaledSpec& spec,
                             const RandomSpec& random) {
  using S = typename C::storage;
  const auto* xs = static_cast<const S*>(x);
  auto* ys = static_cast<S*>(y);
  const ElementGrids<C> grids = element_grids<C>(spec);
  const uint32_t mask = random_mask(random.rbits);
  WordCache cache(make_philox_key(random.seed, random.offset));
  const int64_t width = i1 - i0;
  const bool power_of_two = spec.rule != ScaleRule::amax;
  with_rounding(rounding, [&](auto tag) LPSIM_LAMBDA_INLINE {
    constexpr Rounding R = decltype(tag)::value;
    for_each_run(l, g, p0, p1, i0, i1, [&](int64_t first, int64_t n) LPSIM_LAMBDA_INLINE {
      if (width == 1) {
        if (power_of_two) {
          round_run_one_scale<C, R, true>(xs, ys, first, n, scales[0], grids, mask, cache);
        } else {
          round_run_one_scale<C, R, false>(xs, ys, first, n, scales[0], grids, mask, cache);
        }
        return;
      }
      for (int64_t k = 0; k < n; ++k) {
        const uint32_t word = is_stochastic(R) ? cache(first + k) : 0;
        const BlockScale& b = scales[k % width];
        ys[first + k] = static_cast<S>(
            power_of_two ? scaled_element<R, C, true>(xs[first + k], b, grids, word, mask)
                         : scaled_element<R, C, false>(xs[first + k], b, grids, word, mask));
      }
    });
  });
}

}  // namespace

LPSIM_MULTIVERSION
void scaled_max_abs(Dtype dtype, const void* x, const ScaledLayout& layout, int64_t g, int64_t p0,
                    int64_t p1, int64_t i0, int64_t i1, uint64_t* amax) {
  with_container(dtype, [&](auto container) LPSIM_LAMBDA_INLINE {
    max_abs_impl<decltype(container)>(x, layout, g, p0, p1, i0, i1, amax);
  });
}

LPSIM_MULTIVERSION
void max_abs_bits(Dtype dtype, const void* x, int64_t begin, int64_t end, uint64_t* amax) {
  with_container(dtype, [&](auto container) LPSIM_LAMBDA_INLINE {
    using C = decltype(container);
    using W = typename C::word;
    const auto* xs = static_cast<const typename C::storage*>(x);
    W m = static_cast<W>(*amax);
    for (int64_t i = begin; i < end; ++i) m = max_of(m, magnitude<C>(xs[i]));
    *amax = m;
  });
}

void set_tensor_scale(Dtype dtype, ScaledSpec& spec, uint64_t amax) {
  with_container(dtype, [&](auto container) {
    using C = decltype(container);
    lpsim::set_tensor_scale<C>(spec, static_cast<typename C::word>(amax));
  });
}

void block_scales(Dtype dtype, const ScaledSpec& spec, const uint64_t* amax, int64_t count,
                  BlockScale* scales) {
  with_container(dtype, [&](auto container) {
    using C = decltype(container);
    Grid<ScaledArithmetic<C>> scale_grid{};
    if (spec.rule == ScaleRule::amax) make_grid(spec.scale, scale_grid);  // validated by the op
    for (int64_t k = 0; k < count; ++k) {
      scales[k] = block_scale<C>(static_cast<typename C::word>(amax[k]), spec, scale_grid);
    }
  });
}

LPSIM_MULTIVERSION
void scaled_round(Dtype dtype, Rounding rounding, const void* x, void* y,
                  const ScaledLayout& layout, int64_t g, int64_t p0, int64_t p1, int64_t i0,
                  int64_t i1, const BlockScale* scales, const ScaledSpec& spec,
                  const RandomSpec& random) {
  with_container(dtype, [&](auto container) LPSIM_LAMBDA_INLINE {
    round_impl<decltype(container)>(rounding, x, y, layout, g, p0, p1, i0, i1, scales, spec,
                                    random);
  });
}

}  // namespace lpsim::cpu
