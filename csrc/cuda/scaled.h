// CUDA launcher of the quantize_scaled ops. Plain C++ on raw device pointers, like quantize.h; the
// kernels are in scaled.cu, over the core's definitions (lpsim/scaled.h).
#pragma once

#include <cuda_runtime_api.h>
#include <lpsim/grid_spec.h>
#include <lpsim/rounding.h>
#include <lpsim/rounding_statistics.h>
#include <lpsim/scaled.h>

#include <cstdint>

namespace lpsim::gpu {

// The n > 0 elements of a contiguous tensor rounded into a scaled format: small blocks along the
// last axis (MX, NVFP4) in one pass (small_blocks_kernel, scaled.cu), other layouts in three
// kernels: the blocks' (and the tensor's) largest magnitudes, the blocks' scales, and the
// elements. amax:
// layout.blocks() + 1 zeroed 64-bit words; scales: room for layout.blocks() BlockScales.
template <class C>
void quantize_scaled(Rounding rounding, const void* x, void* y, int64_t n,
                     const ScaledLayout& layout, const ScaledSpec& spec, void* amax, void* scales,
                     const RandomSpec& random, cudaStream_t stream);

// The statistics bounds of every block of the n > 0 elements of a contiguous tensor
// (lpsim/scaled_statistics.h) into bounds[0, layout.blocks()): the kernels of quantize_scaled that
// find the blocks' scales, then one that decodes their limits. amax and scales as for
// quantize_scaled.
template <class C>
void scaled_block_bounds(const void* x, int64_t n, const ScaledLayout& layout,
                         const ScaledSpec& spec, void* amax, void* scales,
                         double element_smallest_normal, StatisticsBounds* bounds,
                         cudaStream_t stream);

}  // namespace lpsim::gpu
