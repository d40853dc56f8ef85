// CPU loops of the statistics ops (see statistics.h), multiversioned for AVX2 (loops.h).
//
// Compiled without trapping math: under GCC's default -ftrapping-math, an operation that may raise
// a floating-point exception cannot be executed speculatively, so the selects of
// element_statistics stay branches and the chunk loop does not vectorise (measured: 6.6 ns per
// float32 element on one core). No code here reads the exception flags, and the flag changes
// which transformations GCC may make, not the value of any operation.
#pragma GCC optimize("no-trapping-math")

#include "cpu/statistics.h"

#include <lpsim/block_statistics.h>
#include <lpsim/philox.h>
#include <lpsim/round.h>

#include <algorithm>

#include "cpu/loops.h"
#include "cpu/round_span.h"
#include "dispatch.h"

namespace lpsim::cpu {

LPSIM_MULTIVERSION
void rounding_statistics(Dtype dtype, const void* x, const void* y, int64_t chunk_begin,
                         int64_t chunk_end, int64_t n, const StatisticsBounds& bounds,
                         ChunkStatistics* chunks) {
  with_container(dtype, [&](auto container) LPSIM_LAMBDA_INLINE {
    using C = decltype(container);
    using S = typename C::storage;
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      const int64_t first = c * kStatisticsChunk;
      chunks[c] =
          chunk_statistics<C>(static_cast<const S*>(x) + first, static_cast<const S*>(y) + first,
                              std::min(kStatisticsChunk, n - first), bounds);
    }
  });
}

// A run of elements in one block at a time (BlockCursor), its bounds rounded outward to the
// comparisons' type (real_bounds).
LPSIM_MULTIVERSION
void rounding_statistics_by_block(Dtype dtype, const void* x, const void* y, int64_t chunk_begin,
                                  int64_t chunk_end, int64_t n, const ScaledLayout& layout,
                                  const StatisticsBounds* block_bounds, ChunkStatistics* chunks) {
  with_container(dtype, [&](auto container) LPSIM_LAMBDA_INLINE {
    using C = decltype(container);
    using S = typename C::storage;
    for (int64_t c = chunk_begin; c < chunk_end; ++c) {
      const int64_t first = c * kStatisticsChunk;
      BlockCursor cursor(layout, first);
      chunks[c] = chunk_statistics_in_runs<C>(
          static_cast<const S*>(x) + first, static_cast<const S*>(y) + first,
          std::min(kStatisticsChunk, n - first), [&](int64_t& length) {
            length = std::min(length, cursor.run());
            const auto b = real_bounds<StatisticsReal<C>>(block_bounds[cursor.block()]);
            cursor.advance(length);
            return b;
          });
    }
  });
}

void block_float_statistics_bounds(Dtype dtype, const uint64_t* max_abs, int64_t count, int32_t wl,
                                   StatisticsBounds* bounds) {
  with_container(dtype, [&](auto container) {
    using C = decltype(container);
    for (int64_t k = 0; k < count; ++k) {
      bounds[k] =
          lpsim::block_float_statistics_bounds<C>(static_cast<typename C::word>(max_abs[k]), wl);
    }
  });
}

LPSIM_MULTIVERSION
void quantize_grid_statistics(Dtype dtype, Rounding rounding, const void* x, void* y,
                              int64_t chunk_begin, int64_t chunk_end, int64_t n,
                              const GridSpec& spec, const RandomSpec& random,
                              const StatisticsBounds& bounds, ChunkStatistics* chunks) {
  static_assert(kStatisticsChunk % kGroupSize == 0, "chunks start on a random-word group");
  with_container(dtype, [&](auto container) LPSIM_LAMBDA_INLINE {
    using C = decltype(container);
    using S = typename C::storage;
    Grid<C> g;
    make_grid<C>(spec, g);  // validated by the caller
    const uint32_t mask = random_mask(random.rbits);
    WordCache cache(make_philox_key(random.seed, random.offset));
    with_rounding(rounding, [&](auto tag) LPSIM_LAMBDA_INLINE {
      constexpr Rounding R = decltype(tag)::value;
      for (int64_t c = chunk_begin; c < chunk_end; ++c) {
        const int64_t first = c * kStatisticsChunk;
        const int64_t count = std::min(kStatisticsChunk, n - first);
        const S* xs = static_cast<const S*>(x) + first;
        S* ys = static_cast<S*>(y) + first;
        round_span<C, R>(xs, ys, first, count, g, mask, cache);
        chunks[c] = chunk_statistics<C>(xs, ys, count, bounds);
      }
    });
  });
}

}  // namespace lpsim::cpu
