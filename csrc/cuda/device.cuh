// Small device helpers of the CUDA kernels: warp shuffles and atomics on container words, 16-byte
// packs, and the launch configuration.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace lpsim::gpu {

constexpr int kThreads = 256;  // threads per block of every kernel
constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

// Container words are uint32_t or uint64_t; CUDA's intrinsics name the 64-bit type
// unsigned long long, which uint64_t (unsigned long) is not.
__device__ __forceinline__ uint32_t shfl_up(uint32_t v, int d) {
  return __shfl_up_sync(kFullMask, v, d);
}
__device__ __forceinline__ uint64_t shfl_up(uint64_t v, int d) {
  return __shfl_up_sync(kFullMask, static_cast<unsigned long long>(v), d);
}
__device__ __forceinline__ uint32_t shfl_xor(uint32_t v, int d) {
  return __shfl_xor_sync(kFullMask, v, d);
}
__device__ __forceinline__ uint64_t shfl_xor(uint64_t v, int d) {
  return __shfl_xor_sync(kFullMask, static_cast<unsigned long long>(v), d);
}
__device__ __forceinline__ uint64_t shfl_index(uint64_t v, int lane) {
  return __shfl_sync(kFullMask, static_cast<unsigned long long>(v), lane);
}
__device__ __forceinline__ void atomic_max(uint32_t* p, uint32_t v) { atomicMax(p, v); }
__device__ __forceinline__ void atomic_max(uint64_t* p, uint64_t v) {
  atomicMax(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}

// The largest of v over the warp, in every lane. All 32 lanes must call it.
template <class W>
__device__ __forceinline__ W warp_max(W v) {
#pragma unroll
  for (int d = kWarp / 2; d > 0; d /= 2) {
    const W other = shfl_xor(v, d);
    v = other > v ? other : v;
  }
  return v;
}

// The largest of v over the thread block, in thread 0 (the other threads get partial maxima). Every
// thread of the block must call it, kThreads of them.
template <class W>
__device__ __forceinline__ W block_max(W v) {
  __shared__ W warp_maxima[kThreads / kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = warp_max(v);
  if (lane == 0) warp_maxima[warp] = v;
  __syncthreads();
  if (warp == 0) v = warp_max(lane < kThreads / kWarp ? warp_maxima[lane] : W(0));
  return v;
}

// The tensor of a work item in a launch over several tensors, tensor t owning the items
// [items_before[t], items_before[t + 1]): the last t < count with items_before[t] <= item, by
// bisection.
__device__ __forceinline__ int tensor_of_item(const uint64_t* items_before, int count,
                                              uint64_t item) {
  int lo = 0, hi = count;  // items_before[lo] <= item < items_before[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (items_before[mid] <= item) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// 16 bytes of storage elements, loaded and stored with one instruction each (the type's alignment
// lets the compiler use 128-bit accesses).
template <class S>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / static_cast<int>(sizeof(S));
  S s[kSize];
};

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The most blocks a grid gets: four waves of the current device at 2048 resident threads per SM.
// The grid-stride loops take the rest, and fewer, longer-lived blocks amortise their set-up.
inline uint64_t max_blocks() {
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return static_cast<uint64_t>(sms) * (2048 / kThreads) * 4;
}

// A grid of `wanted` blocks, capped at max_blocks().
inline unsigned grid_blocks(uint64_t wanted) {
  const uint64_t cap = max_blocks();
  const uint64_t blocks = wanted < cap ? wanted : cap;
  return static_cast<unsigned>(blocks > 0 ? blocks : 1);
}

// Blocks for `items` work items of one thread each.
inline unsigned blocks_for(uint64_t items) {
  return grid_blocks((items + kThreads - 1) / kThreads);
}

}  // namespace lpsim::gpu
