// CUDA kernel of the rounding_statistics op (see statistics.h): a thread block per chunk, a lane
// per thread, the lanes' sums added pairwise in shared memory in the order the CPU loop adds them.
#include <lpsim/rounding_statistics.h>

#include "cuda/device.cuh"
#include "cuda/statistics.h"

namespace lpsim::gpu {
namespace {

static_assert(kThreads == kStatisticsLanes, "a lane per thread");

template <class C>
__global__ void __launch_bounds__(kThreads)
    statistics_kernel(const typename C::storage* x, const typename C::storage* y, int64_t n,
                      RealBounds<StatisticsReal<C>> bounds, ChunkStatistics* chunks) {
  __shared__ double squared_error[kStatisticsLanes];
  __shared__ double squared_value[kStatisticsLanes];
  __shared__ unsigned long long counts[kStatisticsCounts];
  const int lane = threadIdx.x;
  const int64_t chunk_count = (n + kStatisticsChunk - 1) / kStatisticsChunk;
  for (int64_t c = blockIdx.x; c < chunk_count; c += gridDim.x) {
    if (lane < kStatisticsCounts) counts[lane] = 0;
    __syncthreads();
    const int64_t first = c * kStatisticsChunk;
    double error = 0.0, value = 0.0;
    unsigned nonfinite = 0, overflow = 0, underflow = 0, subnormal = 0, unchanged = 0;
    for (int row = 0; row < kStatisticsRows; ++row) {
      const int64_t i = first + int64_t{row} * kStatisticsLanes + lane;
      if (i >= n) break;
      const ElementStatistics s = element_statistics(value_of<C>(x[i]), value_of<C>(y[i]), bounds);
      nonfinite += s.nonfinite;
      overflow += s.overflow;
      underflow += s.underflow;
      subnormal += s.subnormal;
      unchanged += s.unchanged;
      error = add_rn(error, s.squared_error);
      value = add_rn(value, s.squared_value);
    }
    squared_error[lane] = error;
    squared_value[lane] = value;
    atomicAdd(counts + kNonfinite, static_cast<unsigned long long>(nonfinite));
    atomicAdd(counts + kOverflow, static_cast<unsigned long long>(overflow));
    atomicAdd(counts + kUnderflow, static_cast<unsigned long long>(underflow));
    atomicAdd(counts + kSubnormal, static_cast<unsigned long long>(subnormal));
    atomicAdd(counts + kUnchanged, static_cast<unsigned long long>(unchanged));
    __syncthreads();
    for (int width = kStatisticsLanes / 2; width >= 1; width /= 2) {
      if (lane < width) {
        squared_error[lane] = add_rn(squared_error[lane], squared_error[lane + width]);
        squared_value[lane] = add_rn(squared_value[lane], squared_value[lane + width]);
      }
      __syncthreads();
    }
    if (lane == 0) {
      ChunkStatistics chunk;
      chunk.counts[kElements] = n - first < kStatisticsChunk ? n - first : kStatisticsChunk;
      for (int k = kNonfinite; k < kStatisticsCounts; ++k) {
        chunk.counts[k] = static_cast<int64_t>(counts[k]);
      }
      chunk.squared_error = squared_error[0];
      chunk.squared_value = squared_value[0];
      chunks[c] = chunk;
    }
    __syncthreads();  // the shared arrays are reused by the next chunk
  }
}

}  // namespace

template <class C>
void rounding_statistics(const void* x, const void* y, int64_t n, const StatisticsBounds& bounds,
                         ChunkStatistics* chunks, cudaStream_t stream) {
  using S = typename C::storage;
  const int64_t chunk_count = (n + kStatisticsChunk - 1) / kStatisticsChunk;
  statistics_kernel<C><<<grid_blocks(chunk_count), kThreads, 0, stream>>>(
      static_cast<const S*>(x), static_cast<const S*>(y), n, real_bounds<StatisticsReal<C>>(bounds),
      chunks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template void rounding_statistics<Float32Container>(const void*, const void*, int64_t,
                                                    const StatisticsBounds&, ChunkStatistics*,
                                                    cudaStream_t);
template void rounding_statistics<Float64Container>(const void*, const void*, int64_t,
                                                    const StatisticsBounds&, ChunkStatistics*,
                                                    cudaStream_t);
template void rounding_statistics<BFloat16Container>(const void*, const void*, int64_t,
                                                     const StatisticsBounds&, ChunkStatistics*,
                                                     cudaStream_t);
template void rounding_statistics<Float16Container>(const void*, const void*, int64_t,
                                                    const StatisticsBounds&, ChunkStatistics*,
                                                    cudaStream_t);

}  // namespace lpsim::gpu
