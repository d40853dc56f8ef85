// CPU loops of the statistics ops over the core's definition (lpsim/rounding_statistics.h). Plain
// C++ on raw pointers, like every loop file (loops.h); statistics_ops.cpp checks the tensors and
// splits the chunks across threads. chunk_statistics is inline so that the fused quantize loop
// (quantize.cpp) computes a chunk's statistics while the chunk is in cache.
#pragma once

#include <lpsim/grid_spec.h>
#include <lpsim/rounding_statistics.h>
#include <lpsim/scaled.h>
#include <lpsim/types.h>

#include <cstdint>

namespace lpsim::cpu {

// The statistics of x[0, n) rounded to y[0, n), n <= kStatisticsChunk: one chunk, whose elements
// are counted within bounds that hold for runs of consecutive elements: next_run(length), called
// for the elements in turn with length the number left in the row, returns the RealBounds<Real>
// of the next `length` elements, having shortened `length` to those that share them (the values
// are compared as Reals). Lane l is vector slot l of the inner loop, which GCC vectorises (4 lanes
// per AVX2 register).
template <class C, class NextRun>
LPSIM_INLINE ChunkStatistics chunk_statistics_in_runs(const typename C::storage* x,
                                                      const typename C::storage* y, int64_t n,
                                                      NextRun&& next_run) {
  double squared_error[kStatisticsLanes] = {};
  double squared_value[kStatisticsLanes] = {};
  StatisticsCounts counts{};
  for (int64_t row = 0; row * kStatisticsLanes < n; ++row) {
    const int64_t first = row * kStatisticsLanes;
    const int lanes = static_cast<int>(n - first < kStatisticsLanes ? n - first : kStatisticsLanes);
    for (int begin = 0; begin < lanes;) {
      int64_t length = lanes - begin;
      const auto b = next_run(length);
      const int end = begin + static_cast<int>(length);
      for (int l = begin; l < end; ++l) {
        const ElementStatistics s =
            element_statistics(value_of<C>(x[first + l]), value_of<C>(y[first + l]), b);
        add_counts(counts, s);
        squared_error[l] = add_rn(squared_error[l], s.squared_error);
        squared_value[l] = add_rn(squared_value[l], s.squared_value);
      }
      begin = end;
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

// The statistics of one chunk (as chunk_statistics_in_runs) with the same bounds for every
// element: one run per row.
template <class C>
LPSIM_INLINE ChunkStatistics chunk_statistics(const typename C::storage* x,
                                              const typename C::storage* y, int64_t n,
                                              const StatisticsBounds& bounds) {
  const RealBounds<StatisticsReal<C>> b = real_bounds<StatisticsReal<C>>(bounds);
  return chunk_statistics_in_runs<C>(x, y, n, [&b](int64_t&) { return b; });
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

// As rounding_statistics, element i counted within the bounds of its block,
// block_bounds[block_of(layout, i)]: the blocks of a scaled format (lpsim/scaled_statistics.h) or
// of a BlockFloat (lpsim/block_statistics.h, its blocks as tiles).
void rounding_statistics_by_block(Dtype dtype, const void* x, const void* y, int64_t chunk_begin,
                                  int64_t chunk_end, int64_t n, const ScaledLayout& layout,
                                  const StatisticsBounds* block_bounds, ChunkStatistics* chunks);

// bounds[k] = the statistics bounds of a BlockFloat(wl) block whose largest finite magnitude has
// the container bits max_abs[k] (lpsim/block_statistics.h), for k in [0, count).
void block_float_statistics_bounds(Dtype dtype, const uint64_t* max_abs, int64_t count, int32_t wl,
                                   StatisticsBounds* bounds);

}  // namespace lpsim::cpu
