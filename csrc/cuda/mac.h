// CUDA launcher of the mac_matmul op. Plain C++ on raw device pointers, like quantize.h; the kernel
// is in mac.cu, over the core's MacSum (lpsim/mac.h), so its results are the CPU loops' bit for
// bit.
#pragma once

#include <cuda_runtime_api.h>
#include <lpsim/grid_spec.h>
#include <lpsim/mac.h>
#include <lpsim/rounding.h>

#include <cstdint>

namespace lpsim::gpu {

// y[i p + l] (float64 bits) = the MAC's sum of the products a[i, k] b[l, k], k = 0 .. n-1, for the
// m x p results of a (m x n) and b (p x n), both row-major device arrays of container X (float32,
// bfloat16 or float16), m, p >= 1: cpu::mac_matmul's results (cpu/accumulate.h) for the same
// grids and random stream. `product` is nullptr for exact products.
template <class X>
void mac_matmul(Rounding rounding, const void* a, const void* b, uint64_t* y, int64_t m, int64_t n,
                int64_t p, const MacShape& shape, const GridSpec* product, const GridSpec& acc,
                const GridSpec& inner, const RandomSpec& random, cudaStream_t stream);

}  // namespace lpsim::gpu
