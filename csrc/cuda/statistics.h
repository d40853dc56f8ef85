// CUDA launchers of the statistics ops. Plain C++ on raw device pointers, like quantize.h; the
// kernels are in statistics.cu, over the core's definitions (lpsim/rounding_statistics.h,
// lpsim/round.h).
#pragma once

#include <cuda_runtime_api.h>
#include <lpsim/grid_spec.h>
#include <lpsim/rounding.h>
#include <lpsim/rounding_statistics.h>
#include <lpsim/scaled.h>

#include <cstdint>

namespace lpsim::gpu {

// chunks[c] (device memory, one ChunkStatistics per chunk of kStatisticsChunk elements) = the
// statistics of chunk c of the n > 0 contiguous elements of x rounded to y: the bits the CPU loop
// gives.
template <class C>
void rounding_statistics(const void* x, const void* y, int64_t n, const StatisticsBounds& bounds,
                         ChunkStatistics* chunks, cudaStream_t stream);

// y = x (n > 0 contiguous elements) rounded onto the grid by `rounding` (quantize_grid's bits,
// random words included), and chunks[c] the statistics of chunk c of that rounding, as
// rounding_statistics gives them: both in one pass over x.
template <class C>
void quantize_grid_statistics(Rounding rounding, const void* x, void* y, int64_t n,
                              const GridSpec& spec, const RandomSpec& random,
                              const StatisticsBounds& bounds, ChunkStatistics* chunks,
                              cudaStream_t stream);

// As rounding_statistics, element i counted within the bounds of its block,
// block_bounds[block_of(layout, i)] (device memory): the blocks of a scaled format
// (gpu::scaled_block_bounds) or of a BlockFloat (block_float_statistics_bounds, its blocks as
// tiles).
template <class C>
void rounding_statistics_by_block(const void* x, const void* y, int64_t n,
                                  const ScaledLayout& layout, const StatisticsBounds* block_bounds,
                                  ChunkStatistics* chunks, cudaStream_t stream);

// bounds[k] (device memory) = the statistics bounds of a BlockFloat(wl) block whose largest finite
// magnitude has the container bits max_abs[k] (device words of C's word type; gpu::block_max_abs),
// for k in [0, count).
template <class C>
void block_float_statistics_bounds(const void* max_abs, int64_t count, int32_t wl,
                                   StatisticsBounds* bounds, cudaStream_t stream);

}  // namespace lpsim::gpu
