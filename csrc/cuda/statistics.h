// CUDA launcher of the rounding_statistics op. Plain C++ on raw device pointers, like quantize.h;
// the kernel is in statistics.cu, over the core's definition (lpsim/rounding_statistics.h).
#pragma once

#include <cuda_runtime_api.h>
#include <lpsim/rounding_statistics.h>

#include <cstdint>

namespace lpsim::gpu {

// chunks[c] (device memory, one ChunkStatistics per chunk of kStatisticsChunk elements) = the
// statistics of chunk c of the n > 0 contiguous elements of x rounded to y: the bits the CPU loop
// gives.
template <class C>
void rounding_statistics(const void* x, const void* y, int64_t n, const StatisticsBounds& bounds,
                         ChunkStatistics* chunks, cudaStream_t stream);

}  // namespace lpsim::gpu
