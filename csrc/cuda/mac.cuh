// The CUDA kernel of the mac_matmul op and its launcher (see mac.h): a thread per result, each
// running the core's MacSum (lpsim/mac.h) over its terms in increasing k, exactly as the CPU's
// scalar loop does; a thread block computes a tile of kTile x kTile results, reading the operands
// through shared memory kTile terms at a time. MacSum holds every rounding, so this file holds
// none.
#pragma once

#include <lpsim/mac.h>
#include <lpsim/philox.h>

#include "cuda/device.cuh"
#include "cuda/mac.h"
#include "dispatch.h"

namespace lpsim::gpu {
namespace {

using F64 = Float64Container;

constexpr int kTile = 16;  // results per tile side, and terms per shared-memory step
static_assert(kTile * kTile == kThreads, "a result per thread");

// The random word of stream index i (lpsim/philox.h's mapping), as the CPU's WordCache gives it.
struct DeviceWords {
  PhiloxKey key;
  __device__ __forceinline__ uint32_t operator()(int64_t i) const {
    return random_word(static_cast<uint64_t>(i), key);
  }
};

// The grids of one launch, passed by value; product_grid is read only with has_product.
struct MacGrids {
  Grid<F64> product;
  Grid<F64> acc;
  Grid<F64> inner;
  bool has_product;
};

// Tiles in a grid-stride loop: tile t covers rows [ti kTile, ...) of a and of b, ti = t / tiles_p,
// tl = t % tiles_p. Thread (ty, tx) computes result (ti kTile + ty, tl kTile + tx).
template <class X, Rounding R>
__global__ void __launch_bounds__(kThreads)
    mac_kernel(const typename X::storage* a, const typename X::storage* b, uint64_t* y, int64_t m,
               int64_t n, int64_t p, MacShape shape, MacGrids grids, PhiloxKey key, uint32_t mask) {
  using S = typename X::storage;
  using W = typename X::word;
  // One padding column keeps the rows of b_tile, read down a column by a warp, in distinct banks.
  __shared__ S a_tile[kTile][kTile + 1];
  __shared__ S b_tile[kTile][kTile + 1];
  const int tx = threadIdx.x % kTile, ty = threadIdx.x / kTile;
  const int64_t tiles_p = (p + kTile - 1) / kTile;
  const int64_t tiles = (m + kTile - 1) / kTile * tiles_p;
  DeviceWords words{key};
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t row_a = t / tiles_p * kTile, row_b = t % tiles_p * kTile;
    const int64_t i = row_a + ty, l = row_b + tx;
    const bool active = i < m && l < p;
    MacSum<R, DeviceWords> sum(shape, grids.has_product ? &grids.product : nullptr, grids.acc,
                               grids.inner, mask, words, kMacWordsPerTerm * (i * p + l) * n);
    for (int64_t k0 = 0; k0 < n; k0 += kTile) {
      // Thread (ty, tx) brings term k0 + tx of row ty of each operand's tile.
      const int64_t k = k0 + tx;
      a_tile[ty][tx] = row_a + ty < m && k < n ? a[(row_a + ty) * n + k] : S(0);
      b_tile[ty][tx] = row_b + ty < p && k < n ? b[(row_b + ty) * n + k] : S(0);
      __syncthreads();
      if (active) {
        const int terms = n - k0 < kTile ? static_cast<int>(n - k0) : kTile;
        for (int j = 0; j < terms; ++j) {
          sum.template add_operands<X>(W(a_tile[ty][j]), W(b_tile[tx][j]), k0 + j);
        }
      }
      __syncthreads();  // the tiles are overwritten by the next step
    }
    if (active) y[i * p + l] = sum.finish(n);
  }
}

}  // namespace

template <class X>
void mac_matmul(Rounding rounding, const void* a, const void* b, uint64_t* y, int64_t m, int64_t n,
                int64_t p, const MacShape& shape, const GridSpec* product, const GridSpec& acc,
                const GridSpec& inner, const RandomSpec& random, cudaStream_t stream) {
  using S = typename X::storage;
  MacGrids grids{};
  make_grid<F64>(acc, grids.acc);
  make_grid<F64>(inner, grids.inner);
  grids.has_product = product != nullptr;
  if (grids.has_product) make_grid<F64>(*product, grids.product);
  const PhiloxKey key = make_philox_key(random.seed, random.offset);
  const uint32_t mask = random_mask(random.rbits);
  const uint64_t tiles = uint64_t((m + kTile - 1) / kTile) * uint64_t((p + kTile - 1) / kTile);
  with_rounding(rounding, [&](auto rule) {
    mac_kernel<X, decltype(rule)::value><<<grid_blocks(tiles), kThreads, 0, stream>>>(
        static_cast<const S*>(a), static_cast<const S*>(b), y, m, n, p, shape, grids, key, mask);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Instantiates the launcher for container X (one .cu file per container, mac_<container>.cu, so
// that the three compile in parallel).
#define LPSIM_GPU_INSTANTIATE_MAC(X)                                                           \
  template void mac_matmul<X>(Rounding, const void*, const void*, uint64_t*, int64_t, int64_t, \
                              int64_t, const MacShape&, const GridSpec*, const GridSpec&,      \
                              const GridSpec&, const RandomSpec&, cudaStream_t);

}  // namespace lpsim::gpu
