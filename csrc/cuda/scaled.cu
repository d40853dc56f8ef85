// CUDA kernels of the quantize_scaled ops (see scaled.h), over the core's definitions of blocks,
// scales and elements (lpsim/scaled.h), so that every element gets the bits the CPU loops give it:
// small blocks along the last axis (MX, NVFP4) in one pass, a warp's lanes sharing each block's
// maximum (small_blocks_kernel); other layouts in three (every block's maximum by atomics, the
// scales, then one thread per element).
#include <lpsim/philox.h>
#include <lpsim/round.h>
#include <lpsim/scaled.h>
#include <lpsim/scaled_statistics.h>

#include "cuda/device.cuh"
#include "cuda/scaled.h"
#include "dispatch.h"

namespace lpsim::gpu {
namespace {

// amax[block_of(i)] = the largest magnitude bits of the block's elements, and amax[blocks] the
// tensor's (when the format has a tensor scale). A warp takes 32 consecutive elements at a time
// (the whole warp goes round the loop while one of its lanes has an element): where all 32 lie in
// one scale block (MX and NVFP4 blocks along the last axis), the warp's maximum goes to it in one
// atomic, else each element in its own. The tensor's maximum is reduced over the thread block
// first: one atomic per thread block, not per element on one word (which took NVFP4 52 ms on 2^26
// elements on an H100).
template <class C>
__global__ void __launch_bounds__(kThreads)
    max_abs_kernel(const typename C::storage* x, int64_t n, ScaledLayout layout, bool tensor,
                   uint64_t* amax) {
  const int64_t blocks = layout.blocks();
  const int lane = threadIdx.x % kWarp;
  uint64_t tensor_max = 0;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i - lane < n;
       i += int64_t(gridDim.x) * kThreads) {
    const bool active = i < n;
    const uint64_t a = active ? static_cast<typename C::word>(x[i]) & C::abs_mask : 0;
    const uint64_t block = active ? static_cast<uint64_t>(block_of(layout, i)) : ~uint64_t(0);
    tensor_max = a > tensor_max ? a : tensor_max;
    if (__all_sync(kFullMask, block == shfl_index(block, 0))) {
      const uint64_t warp_amax = warp_max(a);
      if (lane == 0) atomic_max(amax + block, warp_amax);
    } else if (active) {
      atomic_max(amax + block, a);
    }
  }
  if (tensor) {
    tensor_max = block_max(tensor_max);
    if (threadIdx.x == 0) atomic_max(amax + blocks, tensor_max);
  }
}

template <class C>
__global__ void __launch_bounds__(kThreads)
    scales_kernel(const uint64_t* amax, ScaledLayout layout, ScaledSpec spec,
                  Grid<ScaledArithmetic<C>> scale_grid, BlockScale* scales) {
  const int64_t blocks = layout.blocks();
  if (spec.two_level) set_tensor_scale<C>(spec, static_cast<typename C::word>(amax[blocks]));
  for (int64_t k = blockIdx.x * int64_t(kThreads) + threadIdx.x; k < blocks;
       k += int64_t(gridDim.x) * kThreads) {
    scales[k] = block_scale<C>(static_cast<typename C::word>(amax[k]), spec, scale_grid);
  }
}

template <class C, Rounding R, bool kPowerOfTwo>
__global__ void __launch_bounds__(kThreads)
    round_kernel(const typename C::storage* x, typename C::storage* y, int64_t n,
                 ScaledLayout layout, const BlockScale* scales, ElementGrids<C> grids,
                 PhiloxKey key, uint32_t mask) {
  using S = typename C::storage;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * kThreads) {
    const uint32_t word = is_stochastic(R) ? random_word(static_cast<uint64_t>(i), key) : 0;
    y[i] = static_cast<S>(
        scaled_element<R, C, kPowerOfTwo>(x[i], scales[block_of(layout, i)], grids, word, mask));
  }
}

// The tensor's largest magnitude bits into *amax (formats with a tensor scale, before
// small_blocks_kernel): one atomic per thread block.
template <class C>
__global__ void __launch_bounds__(kThreads)
    tensor_max_kernel(const typename C::storage* x, int64_t n, uint64_t* amax) {
  uint64_t m = 0;
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * kThreads) {
    const uint64_t a = static_cast<typename C::word>(x[i]) & C::abs_mask;
    m = a > m ? a : m;
  }
  m = block_max(m);
  if (threadIdx.x == 0) atomic_max(amax, m);
}

// Blocks of b consecutive elements along the last axis, b a power of two up to a warp (MX's 32,
// NVFP4's 16), none crossing a row (small_blocks_serve): each block's maximum, scale and elements
// in one pass. 64 threads take a group of random words (kGroupSize elements) at a time, thread t
// its Philox counter's four elements 64 w + t, so that each call serves four elements; for each w
// a warp holds 32 consecutive elements, whole blocks aligned to lanes, whose maxima a butterfly of
// shuffles finds in every lane of the block. Every lane then computes its block's scale (the same
// instructions for the warp as one lane's) and rounds its element: the core's block_scale and
// scaled_element, as the other kernels and the CPU loops.
template <class C, Rounding R, bool kPowerOfTwo>
__global__ void __launch_bounds__(kThreads)
    small_blocks_kernel(const typename C::storage* x, typename C::storage* y, int64_t n,
                        int block_size, ScaledSpec spec, Grid<ScaledArithmetic<C>> scale_grid,
                        ElementGrids<C> grids, PhiloxKey key, uint32_t mask,
                        const uint64_t* tensor_amax) {
  using S = typename C::storage;
  using W = typename C::word;
  constexpr int kGroupThreads = kGroupCounters;
  static_assert(kThreads % kGroupThreads == 0 && kGroupThreads % kWarp == 0,
                "a group's threads are whole warps of one block");
  if (spec.two_level) set_tensor_scale<C>(spec, static_cast<W>(*tensor_amax));
  const int t = threadIdx.x % kGroupThreads;
  const int64_t groups = (n + kGroupSize - 1) / kGroupSize;
  const int64_t per_block = kThreads / kGroupThreads;
  // g is the same in every lane of a warp, so the whole warp goes round the loop together.
  for (int64_t g = blockIdx.x * per_block + threadIdx.x / kGroupThreads; g < groups;
       g += int64_t(gridDim.x) * per_block) {
    PhiloxWords words{{0, 0, 0, 0}};
    if constexpr (is_stochastic(R)) {
      words = philox_counter_words(static_cast<uint64_t>(g) * kGroupCounters + t, key);
    }
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const int64_t i = g * kGroupSize + int64_t(w) * kGroupCounters + t;
      const bool active = i < n;
      const W u = active ? static_cast<W>(x[i]) : W(0);
      W m = u & C::abs_mask;  // inactive lanes fill whole blocks past the end
      for (int d = 1; d < block_size; d *= 2) {
        const W other = shfl_xor(m, d);
        m = other > m ? other : m;
      }
      const BlockScale b = block_scale<C>(m, spec, scale_grid);
      if (active) {
        y[i] = static_cast<S>(scaled_element<R, C, kPowerOfTwo>(u, b, grids, words.w[w], mask));
      }
    }
  }
}

template <class C>
__global__ void __launch_bounds__(kThreads)
    bounds_kernel(const BlockScale* scales, int64_t blocks, ScaledSpec spec, ElementGrids<C> grids,
                  double element_smallest_normal, StatisticsBounds* bounds) {
  for (int64_t k = blockIdx.x * int64_t(kThreads) + threadIdx.x; k < blocks;
       k += int64_t(gridDim.x) * kThreads) {
    bounds[k] = block_statistics_bounds<C>(scales[k], spec, grids, element_smallest_normal);
  }
}

// Whether small_blocks_kernel serves the layout: blocks of a power of two up to a warp along the
// last axis (one row of tiles, no inner indices), the rows' length a multiple of it.
bool small_blocks_serve(const ScaledLayout& l) {
  const int64_t b = l.tile_cols;
  return l.inner == 1 && l.rows == 1 && l.tile_rows == 1 && b >= 1 && b <= kWarp &&
         (b & (b - 1)) == 0 && l.cols % b == 0;
}

}  // namespace

template <class C>
void quantize_scaled(Rounding rounding, const void* x, void* y, int64_t n,
                     const ScaledLayout& layout, const ScaledSpec& spec, void* amax, void* scales,
                     const RandomSpec& random, cudaStream_t stream) {
  using S = typename C::storage;
  const auto* xs = static_cast<const S*>(x);
  auto* words = static_cast<uint64_t*>(amax);
  auto* block_scales = static_cast<BlockScale*>(scales);
  Grid<ScaledArithmetic<C>> scale_grid{};
  if (spec.rule == ScaleRule::amax) make_grid(spec.scale, scale_grid);  // validated by the op
  const ElementGrids<C> grids = element_grids<C>(spec);
  const PhiloxKey key = make_philox_key(random.seed, random.offset);
  const uint32_t mask = random_mask(random.rbits);
  // Small blocks: one pass (after the tensor's maximum, for a tensor scale). Others: every block's
  // maximum, the scales, then the elements.
  const bool small = small_blocks_serve(layout);
  uint64_t* tensor_amax = words + layout.blocks();
  if (small) {
    if (spec.two_level) {
      tensor_max_kernel<C><<<blocks_for(n), kThreads, 0, stream>>>(xs, n, tensor_amax);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  } else {
    max_abs_kernel<C><<<blocks_for(n), kThreads, 0, stream>>>(xs, n, layout, spec.two_level, words);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    scales_kernel<C><<<blocks_for(layout.blocks()), kThreads, 0, stream>>>(
        words, layout, spec, scale_grid, block_scales);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const uint64_t groups = (static_cast<uint64_t>(n) + kGroupSize - 1) / kGroupSize;
  const uint64_t groups_per_block = kThreads / kGroupCounters;
  const unsigned small_blocks = grid_blocks((groups + groups_per_block - 1) / groups_per_block);
  const int block_size = static_cast<int>(layout.tile_cols);
  with_rounding(rounding, [&](auto tag) {
    constexpr Rounding R = decltype(tag)::value;
    with_flag(spec.rule != ScaleRule::amax, [&](auto power_of_two) {
      constexpr bool kPowerOfTwo = decltype(power_of_two)::value;
      if (small) {
        small_blocks_kernel<C, R, kPowerOfTwo><<<small_blocks, kThreads, 0, stream>>>(
            xs, static_cast<S*>(y), n, block_size, spec, scale_grid, grids, key, mask, tensor_amax);
      } else {
        round_kernel<C, R, kPowerOfTwo><<<blocks_for(n), kThreads, 0, stream>>>(
            xs, static_cast<S*>(y), n, layout, block_scales, grids, key, mask);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

template <class C>
void scaled_block_bounds(const void* x, int64_t n, const ScaledLayout& layout,
                         const ScaledSpec& spec, void* amax, void* scales,
                         double element_smallest_normal, StatisticsBounds* bounds,
                         cudaStream_t stream) {
  using S = typename C::storage;
  auto* words = static_cast<uint64_t*>(amax);
  auto* block_scales = static_cast<BlockScale*>(scales);
  Grid<ScaledArithmetic<C>> scale_grid{};
  if (spec.rule == ScaleRule::amax) make_grid(spec.scale, scale_grid);  // validated by the op
  const int64_t blocks = layout.blocks();
  max_abs_kernel<C><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const S*>(x), n, layout,
                                                            spec.two_level, words);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  scales_kernel<C>
      <<<blocks_for(blocks), kThreads, 0, stream>>>(words, layout, spec, scale_grid, block_scales);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  bounds_kernel<C><<<blocks_for(blocks), kThreads, 0, stream>>>(
      block_scales, blocks, spec, element_grids<C>(spec), element_smallest_normal, bounds);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template void quantize_scaled<Float32Container>(Rounding, const void*, void*, int64_t,
                                                const ScaledLayout&, const ScaledSpec&, void*,
                                                void*, const RandomSpec&, cudaStream_t);
template void quantize_scaled<Float64Container>(Rounding, const void*, void*, int64_t,
                                                const ScaledLayout&, const ScaledSpec&, void*,
                                                void*, const RandomSpec&, cudaStream_t);
template void quantize_scaled<BFloat16Container>(Rounding, const void*, void*, int64_t,
                                                 const ScaledLayout&, const ScaledSpec&, void*,
                                                 void*, const RandomSpec&, cudaStream_t);
template void quantize_scaled<Float16Container>(Rounding, const void*, void*, int64_t,
                                                const ScaledLayout&, const ScaledSpec&, void*,
                                                void*, const RandomSpec&, cudaStream_t);

#define LPSIM_SCALED_BLOCK_BOUNDS_(C)                                                              \
  template void scaled_block_bounds<C>(const void*, int64_t, const ScaledLayout&,                  \
                                       const ScaledSpec&, void*, void*, double, StatisticsBounds*, \
                                       cudaStream_t);
LPSIM_SCALED_BLOCK_BOUNDS_(Float32Container)
LPSIM_SCALED_BLOCK_BOUNDS_(Float64Container)
LPSIM_SCALED_BLOCK_BOUNDS_(BFloat16Container)
LPSIM_SCALED_BLOCK_BOUNDS_(Float16Container)
#undef LPSIM_SCALED_BLOCK_BOUNDS_

}  // namespace lpsim::gpu
