// CPU loops of the quantize ops (see quantize.h), multiversioned for AVX2 (loops.h).
#include "cpu/quantize.h"

#include <lpsim/philox.h>
#include <lpsim/round.h>

#include <algorithm>

#include "cpu/loops.h"
#include "cpu/round_span.h"
#include "dispatch.h"

namespace lpsim::cpu {

namespace {

template <class C>
LPSIM_INLINE const typename C::storage* in(const void* p) {
  return static_cast<const typename C::storage*>(p);
}
template <class C>
LPSIM_INLINE typename C::storage* out(void* p) {
  return static_cast<typename C::storage*>(p);
}

// x[0, n) rounded into y[0, n), the elements [first, first + n) of a tensor (see round_span).
template <class C>
LPSIM_INLINE void grid_impl(Rounding rounding, const typename C::storage* x, typename C::storage* y,
                            int64_t first, int64_t n, const GridSpec& spec,
                            const RandomSpec& random) {
  Grid<C> g;
  make_grid<C>(spec, g);  // validated by the caller
  const uint32_t mask = random_mask(random.rbits);
  WordCache cache(make_philox_key(random.seed, random.offset));
  with_rounding(rounding, [&](auto tag) LPSIM_LAMBDA_INLINE {
    constexpr Rounding R = decltype(tag)::value;
    round_span<C, R>(x, y, first, n, g, mask, cache);
  });
}

template <class C>
LPSIM_INLINE void block_classes_impl(Rounding rounding, const void* x, void* y, int64_t begin,
                                     int64_t end, int64_t inner, int64_t classes,
                                     const uint64_t* class_max_abs, int32_t wl,
                                     const RandomSpec& random) {
  using W = typename C::word;
  const uint32_t mask = random_mask(random.rbits);
  WordCache cache(make_philox_key(random.seed, random.offset));
  with_rounding(rounding, [&](auto tag) LPSIM_LAMBDA_INLINE {
    constexpr Rounding R = decltype(tag)::value;
    for (int64_t start = begin; start < end;) {
      const int64_t row = start / inner;
      const int64_t stop = std::min(end, (row + 1) * inner);
      const Grid<C> g = block_grid<C>(static_cast<W>(class_max_abs[row % classes]), wl);
      round_span<C, R>(in<C>(x) + start, out<C>(y) + start, start, stop - start, g, mask, cache);
      start = stop;
    }
  });
}

template <class C>
LPSIM_INLINE void max_abs_impl(const void* x, int64_t begin, int64_t end, int64_t inner,
                               int64_t classes, uint64_t* max_abs) {
  using W = typename C::word;
  const typename C::storage* xs = in<C>(x);
  for (int64_t start = begin; start < end;) {
    const int64_t row = start / inner;
    const int64_t stop = std::min(end, (row + 1) * inner);
    W m = static_cast<W>(max_abs[row % classes]);
    for (int64_t i = start; i < stop; ++i) m = finite_max_abs<C>(m, xs[i]);
    max_abs[row % classes] = m;
    start = stop;
  }
}

// Block b of blocks of block_size consecutive elements along rows of row_len (numbered row-major,
// the last block of a row may be shorter): the elements [start, stop).
struct RowBlock {
  int64_t start, stop;
  RowBlock(int64_t b, int64_t row_len, int64_t block_size) {
    const int64_t per_row = (row_len + block_size - 1) / block_size;
    const int64_t row = b / per_row;
    start = row * row_len + (b % per_row) * block_size;
    stop = std::min(start + block_size, (row + 1) * row_len);
  }
};

template <class C>
LPSIM_INLINE typename C::word block_max_abs(const typename C::storage* xs, const RowBlock& block) {
  typename C::word m = 0;
  for (int64_t i = block.start; i < block.stop; ++i) m = finite_max_abs<C>(m, xs[i]);
  return m;
}

template <class C>
LPSIM_INLINE void blocks_impl(Rounding rounding, const void* x, void* y, int64_t block_begin,
                              int64_t block_end, int64_t row_len, int64_t block_size, int32_t wl,
                              const RandomSpec& random) {
  using W = typename C::word;
  const typename C::storage* xs = in<C>(x);
  const uint32_t mask = random_mask(random.rbits);
  WordCache cache(make_philox_key(random.seed, random.offset));
  with_rounding(rounding, [&](auto tag) LPSIM_LAMBDA_INLINE {
    constexpr Rounding R = decltype(tag)::value;
    for (int64_t b = block_begin; b < block_end; ++b) {
      const RowBlock block(b, row_len, block_size);
      const W m = block_max_abs<C>(xs, block);
      round_span<C, R>(xs + block.start, out<C>(y) + block.start, block.start,
                       block.stop - block.start, block_grid<C>(m, wl), mask, cache);
    }
  });
}

template <class C>
LPSIM_INLINE void blocks_max_abs_impl(const void* x, int64_t block_begin, int64_t block_end,
                                      int64_t row_len, int64_t block_size, uint64_t* block_max) {
  for (int64_t b = block_begin; b < block_end; ++b) {
    block_max[b] = block_max_abs<C>(in<C>(x), RowBlock(b, row_len, block_size));
  }
}

}  // namespace

LPSIM_MULTIVERSION
void quantize_grid(Dtype dtype, Rounding rounding, const void* x, void* y, int64_t begin,
                   int64_t end, const GridSpec& grid, const RandomSpec& random) {
  with_container(dtype, [&](auto container) LPSIM_LAMBDA_INLINE {
    using C = decltype(container);
    grid_impl<C>(rounding, in<C>(x) + begin, out<C>(y) + begin, begin, end - begin, grid, random);
  });
}

LPSIM_MULTIVERSION
void quantize_grid_span(Dtype dtype, Rounding rounding, const void* x, void* y, int64_t first,
                        int64_t n, const GridSpec& grid, const RandomSpec& random) {
  with_container(dtype, [&](auto container) LPSIM_LAMBDA_INLINE {
    using C = decltype(container);
    grid_impl<C>(rounding, in<C>(x), out<C>(y), first, n, grid, random);
  });
}

LPSIM_MULTIVERSION
void quantize_block_classes(Dtype dtype, Rounding rounding, const void* x, void* y, int64_t begin,
                            int64_t end, int64_t inner, int64_t classes,
                            const uint64_t* class_max_abs, int32_t wl, const RandomSpec& random) {
  with_container(dtype, [&](auto container) LPSIM_LAMBDA_INLINE {
    using C = decltype(container);
    block_classes_impl<C>(rounding, x, y, begin, end, inner, classes, class_max_abs, wl, random);
  });
}

LPSIM_MULTIVERSION
void max_abs_classes(Dtype dtype, const void* x, int64_t begin, int64_t end, int64_t inner,
                     int64_t classes, uint64_t* max_abs) {
  with_container(dtype, [&](auto container) LPSIM_LAMBDA_INLINE {
    using C = decltype(container);
    max_abs_impl<C>(x, begin, end, inner, classes, max_abs);
  });
}

LPSIM_MULTIVERSION
void quantize_blocks(Dtype dtype, Rounding rounding, const void* x, void* y, int64_t block_begin,
                     int64_t block_end, int64_t row_len, int64_t block_size, int32_t wl,
                     const RandomSpec& random) {
  with_container(dtype, [&](auto container) LPSIM_LAMBDA_INLINE {
    using C = decltype(container);
    blocks_impl<C>(rounding, x, y, block_begin, block_end, row_len, block_size, wl, random);
  });
}

LPSIM_MULTIVERSION
void blocks_max_abs(Dtype dtype, const void* x, int64_t block_begin, int64_t block_end,
                    int64_t row_len, int64_t block_size, uint64_t* block_max) {
  with_container(dtype, [&](auto container) LPSIM_LAMBDA_INLINE {
    blocks_max_abs_impl<decltype(container)>(x, block_begin, block_end, row_len, block_size,
                                             block_max);
  });
}

}  // namespace lpsim::cpu
