// The CUDA kernels of the quantize ops over the rounding core, and the launchers of quantize.h.
//
// The kernels call the core (round_to_grid, block_grid, finite_max_abs, philox_counter_words) and
// hold no rounding logic of their own. Elements are indexed by their row-major position i, which
// also picks the random word by lpsim/philox.h's mapping, so the results are bit-identical to the
// CPU loops' for the same seed and offset. Every loop is a grid-stride loop over 64-bit indices.
#pragma once

#include <lpsim/grid_spec.h>
#include <lpsim/philox.h>
#include <lpsim/round.h>

#include <type_traits>

#include "cuda/device.cuh"
#include "cuda/pieces.h"
#include "cuda/quantize.h"
#include "dispatch.h"

namespace lpsim::gpu {

// ---- Where an element's grid comes from

// quantize_grid: one grid for every element.
template <class C>
struct UniformGrid {
  Grid<C> grid;
  __device__ __forceinline__ Grid<C> operator()(uint64_t) const { return grid; }
};

// Block formats: the grid of the element's class, from the class's largest finite magnitude.
template <class C>
struct PieceGrid {
  Pieces pieces;
  const typename C::word* class_max;
  int32_t wl;
  __device__ __forceinline__ Grid<C> operator()(uint64_t i) const {
    // A single class (the whole tensor) needs no index arithmetic.
    const uint64_t cls = pieces.classes.divisor == 1 ? 0 : pieces.class_of(i);
    return block_grid<C>(class_max[cls], wl);
  }
};

// ---- Elementwise rounding

// How many work items round_item has for n elements.
template <Rounding R>
__host__ __device__ __forceinline__ uint64_t round_items(uint64_t n) {
  return is_stochastic(R) ? philox_counters_for(n) : n;
}

// Work item `item` of the n elements of x: for the stochastic rules the Philox counter `item`,
// whose words go to its four elements philox_element_of(item, w), so that all four words of each
// call are used and for each w a warp reads and writes 32 consecutive elements; for other rules
// element `item`.
template <class C, Rounding R, class Grids>
__device__ __forceinline__ void round_item(const typename C::storage* x, typename C::storage* y,
                                           uint64_t n, uint64_t item, const Grids& grids,
                                           const PhiloxKey& key, uint32_t mask) {
  using S = typename C::storage;
  using W = typename C::word;
  if constexpr (is_stochastic(R)) {
    const PhiloxWords words = philox_counter_words(item, key);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint64_t i = philox_element_of(item, w);
      if (i < n) y[i] = S(round_to_grid<R, C>(W(x[i]), grids(i), words.w[w], mask));
    }
  } else {
    y[item] = S(round_to_grid<R, C>(W(x[item]), grids(item), 0, 0));
  }
}

// One thread per work item of round_item; for the deterministic rules, one 16-byte pack per thread
// instead when x and y are aligned to 16 bytes.
template <class C, Rounding R, class Grids>
__global__ void __launch_bounds__(kThreads)
    round_kernel(const typename C::storage* x, typename C::storage* y, uint64_t n, Grids grids,
                 PhiloxKey key, uint32_t mask, bool packed) {
  using S = typename C::storage;
  using W = typename C::word;
  const uint64_t first = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  uint64_t done = 0;  // elements handled as packs
  if constexpr (!is_stochastic(R)) {
    if (packed) {
      using P = Pack<S>;
      const uint64_t packs = n / P::kSize;
      for (uint64_t p = first; p < packs; p += stride) {
        P v = reinterpret_cast<const P*>(x)[p];
#pragma unroll
        for (int k = 0; k < P::kSize; ++k) {
          v.s[k] = S(round_to_grid<R, C>(W(v.s[k]), grids(p * P::kSize + k), 0, 0));
        }
        reinterpret_cast<P*>(y)[p] = v;
      }
      done = packs * P::kSize;
    }
  }
  const uint64_t items = round_items<R>(n);
  for (uint64_t item = done + first; item < items; item += stride) {
    round_item<C, R>(x, y, n, item, grids, key, mask);
  }
}

// ---- Many tensors in one launch (quantize_grid_many)

// The tensors of one launch, passed by value as a kernel argument: tensor t owns the work items
// [items_before[t], items_before[t + 1]) of the launch.
template <class C>
struct ManyLaunch {
  typename C::storage* data[kManyTensors];
  uint64_t numel[kManyTensors];
  uint64_t offset[kManyTensors];
  uint64_t items_before[kManyTensors + 1];
  int count;
};

template <class C, Rounding R>
__global__ void __launch_bounds__(kThreads)
    round_many_kernel(ManyLaunch<C> tensors, Grid<C> grid, uint64_t seed, uint32_t mask) {
  const uint64_t first = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  const uint64_t items = tensors.items_before[tensors.count];
  for (uint64_t item = first; item < items; item += stride) {
    const int lo = tensor_of_item(tensors.items_before, tensors.count, item);
    const PhiloxKey key = make_philox_key(seed, tensors.offset[lo]);
    round_item<C, R>(tensors.data[lo], tensors.data[lo], tensors.numel[lo],
                     item - tensors.items_before[lo], UniformGrid<C>{grid}, key, mask);
  }
}

// ---- Largest finite magnitudes per class (block formats, before round_kernel)
//
// atomicMax on the bits of finite magnitudes is exact and independent of the order: they order
// like their unsigned integer bits, and NaN and Inf never enter (finite_max_abs skips them).

constexpr uint64_t kNoClass = ~uint64_t(0);
constexpr int kReduceTile = 16 * kThreads;  // elements a block reads per tile
constexpr int64_t kLongPiece = 1024;        // pieces at least this long use max_abs_pieces_kernel

// Adds a warp's running maximum of class cls to class_max. All 32 lanes must call it.
template <class W>
__device__ __forceinline__ void flush_max(W m, uint64_t cls, W* class_max) {
  m = warp_max(m);
  if (threadIdx.x % kWarp == 0 && cls != kNoClass && m != 0) atomic_max(&class_max[cls], m);
}

// Long pieces, or a single class: each block takes tiles of up to kReduceTile elements within a
// piece and keeps a running maximum while its class stays the same, so a class costs one atomic
// per warp and block, not one per element or tile.
template <class C>
__global__ void __launch_bounds__(kThreads)
    max_abs_pieces_kernel(const typename C::storage* x, Pieces pieces, uint64_t piece_count,
                          typename C::word* class_max) {
  using W = typename C::word;
  const uint64_t tiles_per_piece = (pieces.piece_len.divisor + kReduceTile - 1) / kReduceTile;
  const uint64_t tiles = piece_count * tiles_per_piece;
  W m = 0;
  uint64_t current = kNoClass;
  for (uint64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const uint64_t p = t / tiles_per_piece;
    const uint64_t cls = pieces.classes.mod(p);
    if (cls != current) {  // the same decision in every thread of the block
      flush_max(m, current, class_max);
      m = 0;
      current = cls;
    }
    const uint64_t begin = pieces.start(p) + t % tiles_per_piece * kReduceTile;
    const uint64_t stop = pieces.stop(p);
    const uint64_t end = begin + kReduceTile < stop ? begin + kReduceTile : stop;
    for (uint64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      m = finite_max_abs<C>(m, W(x[i]));
    }
  }
  flush_max(m, current, class_max);
}

// Several classes along rows of inner < kLongPiece elements (element i in class
// (i / inner) % classes). The tensor is read as a matrix of `width` columns, width a multiple of
// classes * inner, so that an element's class depends on its column only: each thread reduces one
// column over a share of the rows (blockIdx.y, step gridDim.y) with no class changes. A block's
// kThreads columns span at most kThreads consecutive values q = col / inner, hence at most
// kThreads classes: slot (q - q0) % classes of shared memory, q0 of the first column, holds class
// (q0 + slot) % classes, and the block then adds one atomic per class instead of one per column.
template <class C>
__global__ void __launch_bounds__(kThreads)
    max_abs_columns_kernel(const typename C::storage* x, uint64_t n, uint64_t width, uint64_t inner,
                           uint64_t classes, typename C::word* class_max) {
  using W = typename C::word;
  __shared__ W slot_max[kThreads];
  const uint64_t rows = (n + width - 1) / width;
  const uint64_t tiles = (width + kThreads - 1) / kThreads;
  const uint64_t slots = classes < kThreads ? classes : kThreads;
  for (uint64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const uint64_t col0 = tile * kThreads;
    const uint64_t col = col0 + threadIdx.x;
    W m = 0;
    if (col < width) {
      for (uint64_t r = blockIdx.y; r < rows; r += gridDim.y) {
        const uint64_t i = r * width + col;
        if (i < n) m = finite_max_abs<C>(m, W(x[i]));
      }
    }
    slot_max[threadIdx.x] = 0;
    __syncthreads();
    const uint64_t q0 = col0 / inner;
    if (m != 0) atomic_max(&slot_max[(col / inner - q0) % classes], m);
    __syncthreads();
    if (threadIdx.x < slots && slot_max[threadIdx.x] != 0) {
      atomic_max(&class_max[(q0 + threadIdx.x) % classes], slot_max[threadIdx.x]);
    }
    __syncthreads();  // slot_max is reset for the next tile
  }
}

// ---- Short blocks (block_size formats), found and rounded in one kernel

constexpr int kTile = 2048;  // the most elements of one tile of round_blocks_kernel

// Each thread block takes tiles of blocks_per_tile whole blocks (contiguous, at most kTile
// elements), finds their maxima into shared memory, then rounds the tile, reading it again from
// the cache. Tiles own whole blocks, as the CPU's tasks do, so an in-place call never reads an
// element another tile has rounded.
template <class C, Rounding R>
__global__ void __launch_bounds__(kThreads)
    round_blocks_kernel(const typename C::storage* x, typename C::storage* y, Pieces blocks,
                        uint64_t block_count, uint64_t blocks_per_tile, int32_t wl, PhiloxKey key,
                        uint32_t mask) {
  using S = typename C::storage;
  using W = typename C::word;
  __shared__ W block_max[kTile];
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const uint64_t tiles = (block_count + blocks_per_tile - 1) / blocks_per_tile;
  for (uint64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const uint64_t b0 = tile * blocks_per_tile;
    const uint64_t b_end = b0 + blocks_per_tile < block_count ? b0 + blocks_per_tile : block_count;
    const uint64_t e0 = blocks.start(b0);
    const uint64_t e1 = blocks.stop(b_end - 1);
    for (uint64_t s = threadIdx.x; s < b_end - b0; s += kThreads) block_max[s] = 0;
    __syncthreads();

    // 1. The blocks' largest finite magnitudes. The lanes of a warp read consecutive elements, so
    // the lanes of one block are consecutive too: a segmented scan (combining only lanes of the
    // same block) leaves each block's maximum in its last lane, which alone does the atomic, where
    // one atomic per element would serialise up to 32 lanes on one shared-memory word. Lanes past
    // the tile count as its last element with magnitude 0, so every lane runs every shuffle.
    for (uint64_t start = e0; start < e1; start += kThreads) {
      const uint64_t i = start + threadIdx.x;
      const bool inside = i < e1;
      W m = inside ? finite_max_abs<C>(W(0), W(x[i])) : W(0);
      const uint32_t slot = static_cast<uint32_t>(blocks.piece_of(inside ? i : e1 - 1) - b0);
#pragma unroll
      for (int d = 1; d < kWarp; d *= 2) {
        const W m_before = shfl_up(m, d);
        const uint32_t slot_before = shfl_up(slot, d);
        if (lane >= d && slot_before == slot) m = max_of(m, m_before);
      }
      const uint32_t slot_after = __shfl_down_sync(kFullMask, slot, 1);
      if ((lane == kWarp - 1 || slot_after != slot) && m != 0) atomic_max(&block_max[slot], m);
    }
    __syncthreads();

    // 2. Round the tile's elements, one thread per Philox counter as in round_kernel, over the
    // counters of the groups the tile overlaps. A group cut by a tile's edge has its words drawn
    // by both tiles, each using them for its own elements only.
    const uint64_t g0 = e0 / kGroupSize;
    const uint64_t counters = ((e1 - 1) / kGroupSize - g0 + 1) * kGroupCounters;
    for (uint64_t k = threadIdx.x; k < counters; k += kThreads) {
      const uint64_t c = g0 * kGroupCounters + k;
      PhiloxWords words{};
      if constexpr (is_stochastic(R)) words = philox_counter_words(c, key);
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const uint64_t i = philox_element_of(c, w);
        if (i >= e0 && i < e1) {
          const Grid<C> g = block_grid<C>(block_max[blocks.piece_of(i) - b0], wl);
          y[i] = S(round_to_grid<R, C>(W(x[i]), g, words.w[w], mask));
        }
      }
    }
    __syncthreads();  // block_max is reset for the next tile
  }
}

// ---- Launchers

template <class C>
const typename C::storage* in(const void* p) {
  return static_cast<const typename C::storage*>(p);
}
template <class C>
typename C::storage* out(void* p) {
  return static_cast<typename C::storage*>(p);
}

template <class C, class Grids>
void launch_round(Rounding rounding, const void* x, void* y, uint64_t n, const Grids& grids,
                  const RandomSpec& random, cudaStream_t stream) {
  using S = typename C::storage;
  const PhiloxKey key = make_philox_key(random.seed, random.offset);
  const uint32_t mask = random_mask(random.rbits);
  const bool packed = aligned16(x) && aligned16(y);
  with_rounding(rounding, [&](auto tag) {
    constexpr Rounding R = decltype(tag)::value;
    const uint64_t items = is_stochastic(R) ? philox_counters_for(n)
                           : packed         ? (n + Pack<S>::kSize - 1) / Pack<S>::kSize
                                            : n;
    round_kernel<C, R, Grids><<<blocks_for(items), kThreads, 0, stream>>>(in<C>(x), out<C>(y), n,
                                                                          grids, key, mask, packed);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// class_max[class] = the largest finite magnitude of the pieces of each class (zeroed before).
template <class C>
void launch_max_abs_pieces(const void* x, const Pieces& pieces, uint64_t piece_count,
                           typename C::word* class_max, cudaStream_t stream) {
  const uint64_t len = pieces.piece_len.divisor;
  const uint64_t tiles = piece_count * ((len + kReduceTile - 1) / kReduceTile);
  max_abs_pieces_kernel<C>
      <<<grid_blocks(tiles), kThreads, 0, stream>>>(in<C>(x), pieces, piece_count, class_max);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class C>
void quantize_grid(Rounding rounding, const void* x, void* y, int64_t n, const GridSpec& spec,
                   const RandomSpec& random, cudaStream_t stream) {
  Grid<C> grid;
  make_grid<C>(spec, grid);  // checked by the caller (grid_spec in checks.cpp)
  launch_round<C>(rounding, x, y, static_cast<uint64_t>(n), UniformGrid<C>{grid}, random, stream);
}

template <class C>
void quantize_grid_many(Rounding rounding, const ManyTensor* tensors, int64_t count,
                        const GridSpec& spec, const RandomSpec& random, cudaStream_t stream) {
  Grid<C> grid;
  make_grid<C>(spec, grid);  // checked by the caller (grid_spec in checks.cpp)
  const uint32_t mask = random_mask(random.rbits);
  with_rounding(rounding, [&](auto tag) {
    constexpr Rounding R = decltype(tag)::value;
    for (int64_t start = 0; start < count; start += kManyTensors) {
      ManyLaunch<C> launch{};
      launch.count = static_cast<int>(count - start < kManyTensors ? count - start : kManyTensors);
      for (int t = 0; t < launch.count; ++t) {
        const ManyTensor& m = tensors[start + t];
        launch.data[t] = out<C>(m.data);
        launch.numel[t] = static_cast<uint64_t>(m.numel);
        launch.offset[t] = m.offset;
        launch.items_before[t + 1] = launch.items_before[t] + round_items<R>(launch.numel[t]);
      }
      const uint64_t items = launch.items_before[launch.count];
      round_many_kernel<C, R>
          <<<blocks_for(items), kThreads, 0, stream>>>(launch, grid, random.seed, mask);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

// The largest finite magnitudes of the classes (quantize_block_classes' layout) into class_max.
template <class C>
void launch_max_abs_classes(const void* x, uint64_t size, int64_t inner, int64_t classes,
                            typename C::word* class_max, cudaStream_t stream) {
  const Pieces pieces = Pieces::along(static_cast<uint64_t>(inner), static_cast<uint64_t>(classes));
  if (classes == 1 || inner >= kLongPiece) {
    launch_max_abs_pieces<C>(x, pieces, size / static_cast<uint64_t>(inner), class_max, stream);
    return;
  }
  const uint64_t period = static_cast<uint64_t>(classes * inner);
  const uint64_t width = period * ((kThreads + period - 1) / period);
  const uint64_t rows = (size + width - 1) / width;
  // Columns across, rows down; each thread should reduce a few rows at least.
  constexpr uint64_t kMinRowsPerThread = 8;
  const unsigned across = blocks_for(width);
  const uint64_t down_cap = max_blocks() / across;
  uint64_t down = (rows + kMinRowsPerThread - 1) / kMinRowsPerThread;
  if (down > down_cap) down = down_cap;
  if (down > 65535) down = 65535;
  if (down < 1) down = 1;
  const dim3 blocks(across, static_cast<unsigned>(down));
  max_abs_columns_kernel<C>
      <<<blocks, kThreads, 0, stream>>>(in<C>(x), size, width, static_cast<uint64_t>(inner),
                                        static_cast<uint64_t>(classes), class_max);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <class C>
void quantize_block_classes(Rounding rounding, const void* x, void* y, int64_t n, int64_t inner,
                            int64_t classes, void* class_max, int32_t wl, const RandomSpec& random,
                            cudaStream_t stream) {
  using W = typename C::word;
  W* maxima = static_cast<W*>(class_max);
  const uint64_t size = static_cast<uint64_t>(n);
  launch_max_abs_classes<C>(x, size, inner, classes, maxima, stream);
  const Pieces pieces = Pieces::along(static_cast<uint64_t>(inner), static_cast<uint64_t>(classes));
  launch_round<C>(rounding, x, y, size, PieceGrid<C>{pieces, maxima, wl}, random, stream);
}

template <class C>
void quantize_blocks(Rounding rounding, const void* x, void* y, int64_t n, int64_t row_len,
                     int64_t block_size, void* block_max, int32_t wl, const RandomSpec& random,
                     cudaStream_t stream) {
  using W = typename C::word;
  const uint64_t size = static_cast<uint64_t>(n);
  const Pieces blocks =
      Pieces::blocks(size, static_cast<uint64_t>(row_len), static_cast<uint64_t>(block_size));
  const uint64_t count = size / static_cast<uint64_t>(row_len) * blocks.per_row;
  const uint64_t len = blocks.piece_len.divisor;  // min(block_size, row_len)
  if (block_scratch_words(n, row_len, block_size) == 0) {
    const PhiloxKey key = make_philox_key(random.seed, random.offset);
    const uint32_t mask = random_mask(random.rbits);
    const uint64_t per_tile = kTile / len;
    const unsigned grid = grid_blocks((count + per_tile - 1) / per_tile);
    with_rounding(rounding, [&](auto tag) {
      constexpr Rounding R = decltype(tag)::value;
      round_blocks_kernel<C, R><<<grid, kThreads, 0, stream>>>(in<C>(x), out<C>(y), blocks, count,
                                                               per_tile, wl, key, mask);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    return;
  }
  W* maxima = static_cast<W*>(block_max);
  launch_max_abs_pieces<C>(x, blocks, count, maxima, stream);
  launch_round<C>(rounding, x, y, size, PieceGrid<C>{blocks, maxima, wl}, random, stream);
}

template <class C>
void block_max_abs(const void* x, int64_t n, const BlockLayout& layout, void* block_max,
                   cudaStream_t stream) {
  using W = typename C::word;
  W* maxima = static_cast<W*>(block_max);
  const uint64_t size = static_cast<uint64_t>(n);
  if (!layout.by_size) {
    launch_max_abs_classes<C>(x, size, layout.inner, layout.classes, maxima, stream);
    return;
  }
  const Pieces blocks = Pieces::blocks(size, static_cast<uint64_t>(layout.row_len),
                                       static_cast<uint64_t>(layout.block_size));
  launch_max_abs_pieces<C>(x, blocks, static_cast<uint64_t>(layout.blocks(n)), maxima, stream);
}

// The launchers of quantize.h for container C (one .cu file per container).
#define LPSIM_GPU_INSTANTIATE(C)                                                                   \
  template void quantize_grid<C>(Rounding, const void*, void*, int64_t, const GridSpec&,           \
                                 const RandomSpec&, cudaStream_t);                                 \
  template void quantize_grid_many<C>(Rounding, const ManyTensor*, int64_t, const GridSpec&,       \
                                      const RandomSpec&, cudaStream_t);                            \
  template void quantize_block_classes<C>(Rounding, const void*, void*, int64_t, int64_t, int64_t, \
                                          void*, int32_t, const RandomSpec&, cudaStream_t);        \
  template void quantize_blocks<C>(Rounding, const void*, void*, int64_t, int64_t, int64_t, void*, \
                                   int32_t, const RandomSpec&, cudaStream_t);                      \
  template void block_max_abs<C>(const void*, int64_t, const BlockLayout&, void*, cudaStream_t);

}  // namespace lpsim::gpu
