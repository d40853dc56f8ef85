// The CUDA kernels of the update ops (see arith_kernels.h), instantiated per container of the
// result by arith_<container>.cu so that the four compile in parallel.
//
// One thread per Philox counter, as in kernels.cuh's round_kernel: counter c = 64 g + l gives the words of elements 256 g + 64 w + l,
// w = 0..3, which is lpsim/philox.h's mapping, so position-keyed words equal the CPU's. The kernel
// loads both operands as words of the compute container K, calls round_sum_to_grid and stores the
// result converted (exactly) to a's container.
#pragma once

#include <lpsim/exact_sum.h>
#include <lpsim/philox.h>

#include <type_traits>

#include "cuda/arith_kernels.h"
#include "cuda/device.cuh"
#include "dispatch.h"

namespace lpsim::gpu::arith {

using F64 = Float64Container;

template <class A, class B>
constexpr bool kEitherIs64 = std::is_same_v<A, F64> || std::is_same_v<B, F64>;

// The container an exact sum of A and B values is computed in (as in cpu/arith_update.cpp).
template <class A, class B>
using SumContainer =
    std::conditional_t<std::is_same_v<A, B>, A,
                       std::conditional_t<kEitherIs64<A, B>, F64, Float32Container>>;

// Operands of sr_add: x[i] and b[i] as words of K.
template <class A, class B, class K>
struct AddOperands {
  const typename A::storage* x;
  const typename B::storage* b;
  __device__ __forceinline__ void operator()(uint64_t i, typename K::word& ua,
                                             typename K::word& ub) const {
    ua = convert_exact<K, A>(typename A::word(x[i]));
    ub = convert_exact<K, B>(typename B::word(b[i]));
  }
};

__device__ __forceinline__ float as_real(uint32_t bits) { return __uint_as_float(bits); }
__device__ __forceinline__ double as_real(uint64_t bits) {
  return __longlong_as_double(static_cast<long long>(bits));
}
__device__ __forceinline__ uint32_t bits_of_real(float v) { return __float_as_uint(v); }
__device__ __forceinline__ uint64_t bits_of_real(double v) {
  return static_cast<uint64_t>(__double_as_longlong(v));
}
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }

// Operands of sr_addc: x[i] and the term value * (t1[i] op t2[i]) computed in K's precision.
template <class A, class TC, class K>
struct AddcOperands {
  using T = std::conditional_t<std::is_same_v<K, F64>, double, float>;
  const typename A::storage* x;
  const typename TC::storage* t1;
  const typename TC::storage* t2;
  T value;
  bool divide;
  __device__ __forceinline__ void operator()(uint64_t i, typename K::word& ua,
                                             typename K::word& ub) const {
    const T p = as_real(convert_exact<K, TC>(typename TC::word(t1[i])));
    const T q = as_real(convert_exact<K, TC>(typename TC::word(t2[i])));
    ub = bits_of_real(divide ? mul_rn(value, div_rn(p, q)) : mul_rn(value, mul_rn(p, q)));
    ua = convert_exact<K, A>(typename A::word(x[i]));
  }
};

template <class A, class K, Rounding R, class Operands>
__global__ void __launch_bounds__(kThreads)
    update_kernel(Operands operands, typename A::storage* y, uint64_t n, Grid<K> g, PhiloxKey key,
                  ValueKey value_key, bool by_value, uint32_t mask) {
  using W = typename K::word;
  const uint64_t first = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  const uint64_t counters = (n + kGroupSize - 1) / kGroupSize * kGroupCounters;
  for (uint64_t c = first; c < counters; c += stride) {
    PhiloxWords words{};
    if (is_stochastic(R) && !by_value) words = philox_counter_words(c, key);
    const uint64_t base = c / kGroupCounters * kGroupSize + c % kGroupCounters;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint64_t i = base + uint64_t(w) * kGroupCounters;
      if (i >= n) continue;
      W ua, ub;
      operands(i, ua, ub);
      uint32_t word = words.w[w];
      if (is_stochastic(R) && by_value) {
        word = value_word(convert_exact<F64, K>(ua), convert_exact<F64, K>(ub), value_key);
      }
      const W r = round_sum_to_grid<R, K>(ua, ub, g, word, mask);
      y[i] = static_cast<typename A::storage>(convert_exact<A, K>(r));
    }
  }
}

template <class A, class K, class Operands>
void launch(const Operands& operands, Rounding rounding, cpu::Randomness randomness, void* y,
            int64_t n, const GridSpec& spec, const RandomSpec& random, cudaStream_t stream) {
  Grid<K> grid;
  make_grid<K>(spec, grid);  // checked by the caller (sum_grid_spec); K holds A
  const PhiloxKey key = make_philox_key(random.seed, random.offset);
  const ValueKey value_key = make_value_key(random.seed, random.offset);
  const bool by_value = randomness == cpu::Randomness::value;
  const uint32_t mask = random_mask(random.rbits);
  const uint64_t size = static_cast<uint64_t>(n);
  const uint64_t counters = (size + kGroupSize - 1) / kGroupSize * kGroupCounters;
  with_rounding(rounding, [&](auto tag) {
    constexpr Rounding R = decltype(tag)::value;
    update_kernel<A, K, R, Operands><<<blocks_for(counters), kThreads, 0, stream>>>(
        operands, static_cast<typename A::storage*>(y), size, grid, key, value_key, by_value, mask);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// Call f(B{}) for the container of the operand `b` of an update of an A tensor: A's, float32 or
// float64.
template <class A, class F>
void with_operand(cpu::Dtype b, F&& f) {
  if (b == cpu::Dtype::float32) return f(Float32Container{});
  if (b == cpu::Dtype::float64) return f(F64{});
  return f(A{});
}

// The launchers of arith_kernels.h for result container A.
template <class A>
void add_rounded_for(cpu::Dtype b, Rounding rounding, cpu::Randomness randomness, const void* x,
                     const void* bv, void* y, int64_t n, const GridSpec& grid,
                     const RandomSpec& random, cudaStream_t stream) {
  with_operand<A>(b, [&](auto cb) {
    using B = decltype(cb);
    using K = SumContainer<A, B>;
    const AddOperands<A, B, K> operands{static_cast<const typename A::storage*>(x),
                                        static_cast<const typename B::storage*>(bv)};
    launch<A, K>(operands, rounding, randomness, y, n, grid, random, stream);
  });
}

template <class A>
void addc_rounded_for(cpu::Dtype t, bool divide, double value, Rounding rounding,
                      cpu::Randomness randomness, const void* x, const void* t1, const void* t2,
                      void* y, int64_t n, const GridSpec& grid, const RandomSpec& random,
                      cudaStream_t stream) {
  with_operand<A>(t, [&](auto ct) {
    using TC = decltype(ct);
    using K = std::conditional_t<kEitherIs64<A, TC>, F64, Float32Container>;
    using Operands = AddcOperands<A, TC, K>;
    const Operands operands{static_cast<const typename A::storage*>(x),
                            static_cast<const typename TC::storage*>(t1),
                            static_cast<const typename TC::storage*>(t2),
                            static_cast<typename Operands::T>(value), divide};
    launch<A, K>(operands, rounding, randomness, y, n, grid, random, stream);
  });
}

// The launchers' instantiations for A: `LPSIM_GPU_ARITH_INSTANCES(, A)` defines them (one .cu file
// per container), `LPSIM_GPU_ARITH_INSTANCES(extern, A)` keeps other files from instantiating them.
#define LPSIM_GPU_ARITH_INSTANCES(prefix, A)                                                     \
  prefix template void add_rounded_for<A>(cpu::Dtype, Rounding, cpu::Randomness, const void*,   \
                                          const void*, void*, int64_t, const GridSpec&,          \
                                          const RandomSpec&, cudaStream_t);                      \
  prefix template void addc_rounded_for<A>(cpu::Dtype, bool, double, Rounding, cpu::Randomness, \
                                           const void*, const void*, const void*, void*,         \
                                           int64_t, const GridSpec&, const RandomSpec&,          \
                                           cudaStream_t);

}  // namespace lpsim::gpu::arith
