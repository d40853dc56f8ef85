// CUDA launchers of the quantize ops. Plain C++ on raw device pointers, like cpu/quantize.h: only
// the .cu files compile device code, and only quantize_ops.cpp includes torch's headers with
// them. Each launcher
// handles the n > 0 elements of one contiguous tensor on the current device, indexed by row-major
// position (which also selects an element's random word), and enqueues its kernels on `stream`.
//
// The templates are defined in quantize.cuh and instantiated for each container by one .cu file
// each (quantize_<container>.cu), so that the four compile in parallel.
#pragma once

#include <cuda_runtime_api.h>
#include <lpsim/grid_spec.h>
#include <lpsim/rounding.h>

#include <cstdint>

#include "block_layout.h"

namespace lpsim::gpu {

// Blocks of at most this many elements are found and rounded by one kernel that holds a tile of
// blocks per thread block; longer ones take a reduction kernel and then the rounding kernel.
constexpr int64_t kFusedMaxBlock = 512;

// Every element rounded onto the grid of `spec`.
template <class C>
void quantize_grid(Rounding rounding, const void* x, void* y, int64_t n, const GridSpec& spec,
                   const RandomSpec& random, cudaStream_t stream);

// Block floating point with one exponent per class: element i is in class (i / inner) % classes
// (classes = 1, inner = n: the whole tensor). class_max: `classes` zeroed words of the container's
// word type (uint32 or uint64), where the classes' largest finite magnitudes are accumulated.
template <class C>
void quantize_block_classes(Rounding rounding, const void* x, void* y, int64_t n, int64_t inner,
                            int64_t classes, void* class_max, int32_t wl, const RandomSpec& random,
                            cudaStream_t stream);

// The number of zeroed words quantize_blocks needs in block_max: 0 for blocks short enough to be
// fused (min(block_size, row_len) <= kFusedMaxBlock), else one per block.
inline int64_t block_scratch_words(int64_t n, int64_t row_len, int64_t block_size) {
  const int64_t len = block_size < row_len ? block_size : row_len;
  return len <= kFusedMaxBlock ? 0 : n / row_len * ((row_len + len - 1) / len);
}

// Block floating point with blocks of block_size consecutive elements along rows of row_len (the
// last block of a row may be shorter). block_max: block_scratch_words() zeroed container words.
template <class C>
void quantize_blocks(Rounding rounding, const void* x, void* y, int64_t n, int64_t row_len,
                     int64_t block_size, void* block_max, int32_t wl, const RandomSpec& random,
                     cudaStream_t stream);

// The largest finite magnitude of each of the layout's blocks of the n > 0 elements of x, into
// block_max: layout.blocks(n) zeroed words of the container's word type, in block order.
template <class C>
void block_max_abs(const void* x, int64_t n, const BlockLayout& layout, void* block_max,
                   cudaStream_t stream);

// One tensor of quantize_grid_many: n > 0 contiguous elements rounded in place, drawing their
// random words from the stream `offset` under the call's seed.
struct ManyTensor {
  void* data;
  int64_t numel;
  uint64_t offset;
};

// The most tensors one launch of quantize_grid_many rounds: their descriptors travel as kernel
// arguments, which must stay below CUDA's 4 KiB.
constexpr int kManyTensors = 48;

// Every element of `count` tensors of container C rounded in place onto the grid of `spec`, one
// launch per kManyTensors tensors. random.offset is not used: each tensor has its own.
template <class C>
void quantize_grid_many(Rounding rounding, const ManyTensor* tensors, int64_t count,
                        const GridSpec& spec, const RandomSpec& random, cudaStream_t stream);

}  // namespace lpsim::gpu
