// CPU loops of the statistics ops over the core's definition (lpsim/rounding_statistics.h). Plain
// C++ on raw pointers, like every loop file (loops.h); statistics_ops.cpp checks the tensors and
// splits the chunks across threads. chunk_statistics is inline so that the fused quantize loop
// (quantize.cpp) computes a chunk's statistics while the chunk is in cache.
#pragma once

#include <lpsim/grid_spec.h>
#include <lpsim/rounding_statistics.h>
#include <lpsim/types.h>

#include <cstdint>

namespace lpsim::cpu {

// The statistics of x[0, n) rounded to y[0, n), n <= kStatisticsChunk: one chunk. Lane l is vector
// slot l of the inner loop, which GCC vectorises (4 lanes per AVX2 register).
template <class C>
LPSIM_INLINE ChunkStatistics chunk_statistics(const typename C::storage* x,
                                              const typename C::storage* y, int64_t n,
                                              const StatisticsBounds& bounds) {
  double squared_error[kStatisticsLanes] = {};
  double squared_value[kStatisticsLanes] = {};
  StatisticsCounts counts{};
  const RealBounds<StatisticsReal<C>> b = real_bounds<StatisticsReal<C>>(bounds);
  for (int64_t row = 0; row * kStatisticsLanes < n; ++row) {
    const int64_t first = row * kStatisticsLanes;
    const int lanes = static_cast<int>(n - first < kStatisticsLanes ? n - first : kStatisticsLanes);
    for (int l = 0; l < lanes; ++l) {
      const ElementStatistics s =
          element_statistics(value_of<C>(x[first + l]), value_of<C>(y[first + l]), b);
      add_counts(counts, s);
      squared_error[l] = add_rn(squared_error[l], s.squared_error);
      squared_value[l] = add_rn(squared_value[l], s.squared_value);
    }
  }
  ChunkStatistics chunk;
  chunk.counts[kElements] = n;
  chunk.counts[kNonfinite] = counts.nonfinite;
  chunk.counts[kOverflow] = counts.overflow;
  chunk.counts[kUnderflow] = counts.underflow;
  chunk.counts[kSubnormal] = counts.subnormal;
  chunk.counts[kUnchanged] = counts.unchanged;
  chunk.squared_error = add_lanes(squared_error);
  chunk.squared_value = add_lanes(squared_value);
  return chunk;
}

// chunks[c] = the statistics of chunk c of x (n elements) rounded to y, for c in
// [chunk_begin, chunk_end).
void rounding_statistics(Dtype dtype, const void* x, const void* y, int64_t chunk_begin,
                         int64_t chunk_end, int64_t n, const StatisticsBounds& bounds,
                         ChunkStatistics* chunks);

// quantize_grid (quantize.h) of the chunks [chunk_begin, chunk_end) of x (n elements) into y, with
// each chunk's statistics in chunks[c], computed right after the chunk is rounded.
void quantize_grid_statistics(Dtype dtype, Rounding rounding, const void* x, void* y,
                              int64_t chunk_begin, int64_t chunk_end, int64_t n,
                              const GridSpec& grid, const RandomSpec& random,
                              const StatisticsBounds& bounds, ChunkStatistics* chunks);

}  // namespace lpsim::cpu
