// CUDA kernels of the statistics ops (see statistics.h): rounding_statistics takes a chunk per
// thread block, a lane per thread; quantize_grid_statistics rounds and counts in one pass, a chunk
// per quarter of a block. Both add the lanes' sums pairwise in shared memory in the order the CPU
// loop adds them.
#include <lpsim/block_statistics.h>
#include <lpsim/grid_spec.h>
#include <lpsim/philox.h>
#include <lpsim/round.h>
#include <lpsim/rounding_statistics.h>

#include "cuda/device.cuh"
#include "cuda/statistics.h"
#include "dispatch.h"

namespace lpsim::gpu {
namespace {

static_assert(kThreads == kStatisticsLanes, "a lane per thread");

// A chunk's statistics in shared memory, and the steps both kernels take with them.
struct SharedChunk {
  double squared_error[kStatisticsLanes];
  double squared_value[kStatisticsLanes];
  unsigned long long counts[kStatisticsCounts];
};

// Adds a thread's counts into the chunk's.
__device__ __forceinline__ void add_shared_counts(SharedChunk& chunk, const StatisticsCounts& c) {
  atomicAdd(&chunk.counts[kNonfinite], static_cast<unsigned long long>(c.nonfinite));
  atomicAdd(&chunk.counts[kOverflow], static_cast<unsigned long long>(c.overflow));
  atomicAdd(&chunk.counts[kUnderflow], static_cast<unsigned long long>(c.underflow));
  atomicAdd(&chunk.counts[kSubnormal], static_cast<unsigned long long>(c.subnormal));
  atomicAdd(&chunk.counts[kUnchanged], static_cast<unsigned long long>(c.unchanged));
}

// Adds the lanes' sums pairwise into lane 0 (lpsim/rounding_statistics.h's order), thread t of
// `threads` taking lanes t, t + threads, ... of each step. Every thread of the block must call it
// (the barriers), after the lanes are written and a barrier.
__device__ __forceinline__ void add_shared_lanes(SharedChunk& chunk, int t, int threads) {
  for (int width = kStatisticsLanes / 2; width >= 1; width /= 2) {
    for (int lane = t; lane < width; lane += threads) {
      chunk.squared_error[lane] =
          add_rn(chunk.squared_error[lane], chunk.squared_error[lane + width]);
      chunk.squared_value[lane] =
          add_rn(chunk.squared_value[lane], chunk.squared_value[lane + width]);
    }
    __syncthreads();
  }
}

// Chunk c's statistics, once its lanes are added.
__device__ __forceinline__ ChunkStatistics finished_chunk(const SharedChunk& shared, int64_t c,
                                                          int64_t n) {
  const int64_t first = c * kStatisticsChunk;
  ChunkStatistics chunk;
  chunk.counts[kElements] = n - first < kStatisticsChunk ? n - first : kStatisticsChunk;
  for (int k = kNonfinite; k < kStatisticsCounts; ++k) {
    chunk.counts[k] = static_cast<int64_t>(shared.counts[k]);
  }
  chunk.squared_error = shared.squared_error[0];
  chunk.squared_value = shared.squared_value[0];
  return chunk;
}

// The bounds of every element: one RealBounds for all.
template <class Real>
struct SameBounds {
  RealBounds<Real> bounds;
  __device__ __forceinline__ RealBounds<Real> operator()(int64_t) const { return bounds; }
};

// The bounds of element i: its block's, compared in double (in which they are exact).
struct BoundsByBlock {
  ScaledLayout layout;
  const StatisticsBounds* block_bounds;
  __device__ __forceinline__ RealBounds<double> operator()(int64_t i) const {
    const StatisticsBounds b = block_bounds[block_of(layout, i)];
    return RealBounds<double>{b.low, b.high, b.smallest_normal};
  }
};

// A chunk per thread block, a lane per thread; element i counted within bounds_at(i).
template <class C, class BoundsAt>
__global__ void __launch_bounds__(kThreads)
    statistics_kernel(const typename C::storage* x, const typename C::storage* y, int64_t n,
                      BoundsAt bounds_at, ChunkStatistics* chunks) {
  __shared__ SharedChunk shared;
  const int lane = threadIdx.x;
  const int64_t chunk_count = (n + kStatisticsChunk - 1) / kStatisticsChunk;
  for (int64_t c = blockIdx.x; c < chunk_count; c += gridDim.x) {
    if (lane < kStatisticsCounts) shared.counts[lane] = 0;
    __syncthreads();
    const int64_t first = c * kStatisticsChunk;
    double error = 0.0, value = 0.0;
    StatisticsCounts counts{};
    for (int row = 0; row < kStatisticsRows; ++row) {
      const int64_t i = first + int64_t{row} * kStatisticsLanes + lane;
      if (i >= n) break;
      const auto b = bounds_at(i);
      using Real = decltype(b.low);
      const ElementStatistics s = element_statistics<Real>(value_of<C>(x[i]), value_of<C>(y[i]), b);
      add_counts(counts, s);
      error = add_rn(error, s.squared_error);
      value = add_rn(value, s.squared_value);
    }
    shared.squared_error[lane] = error;
    shared.squared_value[lane] = value;
    add_shared_counts(shared, counts);
    __syncthreads();
    add_shared_lanes(shared, lane, kStatisticsLanes);
    if (lane == 0) chunks[c] = finished_chunk(shared, c, n);
    __syncthreads();  // the shared arrays are reused by the next chunk
  }
}

// ---- quantize_grid_statistics: the rounding and its statistics in one pass
//
// A chunk is kStatisticsRows rows of one random-word group each (kStatisticsLanes = kGroupSize
// elements), and a quarter of a block takes it: its thread t holds the lanes t + 64 w (w = 0..3),
// which in every row are the four elements of Philox counter 64 g + t of the row's group g. So each
// Philox call serves four elements, each lane's sums still run over its rows in order, and the
// lanes are then added pairwise as in statistics_kernel: the CPU loop's bits, with quantize_grid's
// y.
constexpr int kChunkThreads = kGroupCounters;              // threads per chunk
constexpr int kChunksPerBlock = kThreads / kChunkThreads;  // chunks a block takes at a time
static_assert(kStatisticsLanes == kGroupSize, "a chunk's row is one group of random words");
static_assert(kThreads % kChunkThreads == 0, "a block holds whole chunks");

template <class C, Rounding R>
__global__ void __launch_bounds__(kThreads)
    quantize_statistics_kernel(const typename C::storage* x, typename C::storage* y, int64_t n,
                               Grid<C> grid, PhiloxKey key, uint32_t mask,
                               RealBounds<StatisticsReal<C>> bounds, ChunkStatistics* chunks) {
  using S = typename C::storage;
  using W = typename C::word;
  constexpr int kWords = kStatisticsLanes / kChunkThreads;  // lanes per thread: 4
  __shared__ SharedChunk shared[kChunksPerBlock];
  const int part = threadIdx.x / kChunkThreads;
  const int t = threadIdx.x % kChunkThreads;
  const int64_t chunk_count = (n + kStatisticsChunk - 1) / kStatisticsChunk;
  // Every thread of the block runs the same iterations (the barriers); a part whose chunk lies past
  // the end idles through them.
  for (int64_t c0 = int64_t{blockIdx.x} * kChunksPerBlock; c0 < chunk_count;
       c0 += int64_t{gridDim.x} * kChunksPerBlock) {
    const int64_t c = c0 + part;
    if (t < kStatisticsCounts) shared[part].counts[t] = 0;
    __syncthreads();
    double error[kWords], value[kWords];
#pragma unroll
    for (int w = 0; w < kWords; ++w) error[w] = value[w] = 0.0;
    StatisticsCounts counts{};
    if (c < chunk_count) {
      const int64_t first = c * kStatisticsChunk;
      for (int row = 0; row < kStatisticsRows; ++row) {
        const int64_t group_first = first + int64_t{row} * kStatisticsLanes;
        if (group_first >= n) break;
        PhiloxWords words{{0, 0, 0, 0}};
        if constexpr (is_stochastic(R)) {
          words = philox_counter_words(philox_counter_of(uint64_t(group_first) + t), key);
        }
#pragma unroll
        for (int w = 0; w < kWords; ++w) {
          const int64_t i = group_first + t + int64_t{w} * kChunkThreads;
          if (i >= n) continue;
          const S v = x[i];
          const S r = S(round_to_grid<R, C>(W(v), grid, words.w[w], mask));
          y[i] = r;
          const ElementStatistics s = element_statistics(value_of<C>(v), value_of<C>(r), bounds);
          add_counts(counts, s);
          error[w] = add_rn(error[w], s.squared_error);
          value[w] = add_rn(value[w], s.squared_value);
        }
      }
    }
#pragma unroll
    for (int w = 0; w < kWords; ++w) {
      shared[part].squared_error[t + w * kChunkThreads] = error[w];
      shared[part].squared_value[t + w * kChunkThreads] = value[w];
    }
    add_shared_counts(shared[part], counts);
    __syncthreads();
    add_shared_lanes(shared[part], t, kChunkThreads);
    if (t == 0 && c < chunk_count) chunks[c] = finished_chunk(shared[part], c, n);
    __syncthreads();  // the shared arrays are reused by the next chunks
  }
}

// One thread per BlockFloat block: its bounds from its largest finite magnitude.
template <class C>
__global__ void __launch_bounds__(kThreads)
    block_float_bounds_kernel(const typename C::word* max_abs, int64_t count, int32_t wl,
                              StatisticsBounds* bounds) {
  for (int64_t k = blockIdx.x * int64_t(kThreads) + threadIdx.x; k < count;
       k += int64_t(gridDim.x) * kThreads) {
    bounds[k] = lpsim::block_float_statistics_bounds<C>(max_abs[k], wl);
  }
}

}  // namespace

template <class C>
void rounding_statistics(const void* x, const void* y, int64_t n, const StatisticsBounds& bounds,
                         ChunkStatistics* chunks, cudaStream_t stream) {
  using S = typename C::storage;
  const int64_t chunk_count = (n + kStatisticsChunk - 1) / kStatisticsChunk;
  statistics_kernel<C><<<grid_blocks(chunk_count), kThreads, 0, stream>>>(
      static_cast<const S*>(x), static_cast<const S*>(y), n,
      SameBounds<StatisticsReal<C>>{real_bounds<StatisticsReal<C>>(bounds)}, chunks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class C>
void rounding_statistics_by_block(const void* x, const void* y, int64_t n,
                                  const ScaledLayout& layout, const StatisticsBounds* block_bounds,
                                  ChunkStatistics* chunks, cudaStream_t stream) {
  using S = typename C::storage;
  const int64_t chunk_count = (n + kStatisticsChunk - 1) / kStatisticsChunk;
  statistics_kernel<C><<<grid_blocks(chunk_count), kThreads, 0, stream>>>(
      static_cast<const S*>(x), static_cast<const S*>(y), n, BoundsByBlock{layout, block_bounds},
      chunks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class C>
void block_float_statistics_bounds(const void* max_abs, int64_t count, int32_t wl,
                                   StatisticsBounds* bounds, cudaStream_t stream) {
  block_float_bounds_kernel<C><<<blocks_for(count), kThreads, 0, stream>>>(
      static_cast<const typename C::word*>(max_abs), count, wl, bounds);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class C>
void quantize_grid_statistics(Rounding rounding, const void* x, void* y, int64_t n,
                              const GridSpec& spec, const RandomSpec& random,
                              const StatisticsBounds& bounds, ChunkStatistics* chunks,
                              cudaStream_t stream) {
  using S = typename C::storage;
  Grid<C> grid;
  make_grid<C>(spec, grid);  // checked by the caller (grid_spec in checks.cpp)
  const PhiloxKey key = make_philox_key(random.seed, random.offset);
  const uint32_t mask = random_mask(random.rbits);
  const int64_t chunk_count = (n + kStatisticsChunk - 1) / kStatisticsChunk;
  const unsigned blocks = grid_blocks((chunk_count + kChunksPerBlock - 1) / kChunksPerBlock);
  with_rounding(rounding, [&](auto tag) {
    constexpr Rounding R = decltype(tag)::value;
    quantize_statistics_kernel<C, R><<<blocks, kThreads, 0, stream>>>(
        static_cast<const S*>(x), static_cast<S*>(y), n, grid, key, mask,
        real_bounds<StatisticsReal<C>>(bounds), chunks);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// The launchers for each container.
#define LPSIM_STATISTICS_LAUNCHERS(C)                                                              \
  template void rounding_statistics<C>(const void*, const void*, int64_t, const StatisticsBounds&, \
                                       ChunkStatistics*, cudaStream_t);                            \
  template void quantize_grid_statistics<C>(                                                       \
      Rounding, const void*, void*, int64_t, const GridSpec&, const RandomSpec&,                   \
      const StatisticsBounds&, ChunkStatistics*, cudaStream_t);                                    \
  template void rounding_statistics_by_block<C>(const void*, const void*, int64_t,                 \
                                                const ScaledLayout&, const StatisticsBounds*,      \
                                                ChunkStatistics*, cudaStream_t);                   \
  template void block_float_statistics_bounds<C>(const void*, int64_t, int32_t, StatisticsBounds*, \
                                                 cudaStream_t);

LPSIM_STATISTICS_LAUNCHERS(Float32Container)
LPSIM_STATISTICS_LAUNCHERS(Float64Container)
LPSIM_STATISTICS_LAUNCHERS(BFloat16Container)
LPSIM_STATISTICS_LAUNCHERS(Float16Container)

}  // namespace lpsim::gpu
