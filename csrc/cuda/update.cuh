// The CUDA kernels of the update ops (see update.h), instantiated per container of the result by
// update_<container>.cu so that the four compile in parallel.
//
// One thread per Philox counter, as in quantize.cuh's round_kernel: counter c gives the words of
// the elements philox_element_of(c, w), w = 0..3, which is lpsim/philox.h's mapping, so
// position-keyed words equal the CPU's. The kernel loads both operands as words of the compute
// container K with lpsim/update.h's AddOperands or AddcOperands (as the CPU loops do), calls
// round_sum_to_grid and stores the result converted (exactly) to a's container.
#pragma once

#include <lpsim/exact_sum.h>
#include <lpsim/philox.h>
#include <lpsim/update.h>

#include "cuda/device.cuh"
#include "cuda/update.h"
#include "dispatch.h"

namespace lpsim::gpu::update {

template <class A, class K, Rounding R, class Operands>
__global__ void __launch_bounds__(kThreads)
    update_kernel(Operands operands, typename A::storage* y, uint64_t n, Grid<K> g, PhiloxKey key,
                  ValueKey value_key, bool by_value, uint32_t mask) {
  using W = typename K::word;
  const uint64_t first = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  const uint64_t counters = philox_counters_for(n);
  for (uint64_t c = first; c < counters; c += stride) {
    PhiloxWords words{};
    if (is_stochastic(R) && !by_value) words = philox_counter_words(c, key);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint64_t i = philox_element_of(c, w);
      if (i >= n) continue;
      W ua, ub;
      operands(i, ua, ub);
      uint32_t word = words.w[w];
      if (is_stochastic(R) && by_value) word = update_value_word<K>(ua, ub, value_key);
      const W r = round_sum_to_grid<R, K>(ua, ub, g, word, mask);
      y[i] = static_cast<typename A::storage>(convert_exact<A, K>(r));
    }
  }
}

template <class A, class K, class Operands>
void launch(const Operands& operands, Rounding rounding, Randomness randomness, void* y, int64_t n,
            const GridSpec& spec, const RandomSpec& random, cudaStream_t stream) {
  Grid<K> grid;
  make_grid<K>(spec, grid);  // checked by the caller (sum_grid_spec); K holds A
  const PhiloxKey key = make_philox_key(random.seed, random.offset);
  const ValueKey value_key = make_value_key(random.seed, random.offset);
  const bool by_value = randomness == Randomness::value;
  const uint32_t mask = random_mask(random.rbits);
  const uint64_t size = static_cast<uint64_t>(n);
  with_rounding(rounding, [&](auto tag) {
    constexpr Rounding R = decltype(tag)::value;
    update_kernel<A, K, R, Operands>
        <<<blocks_for(philox_counters_for(size)), kThreads, 0, stream>>>(
            operands, static_cast<typename A::storage*>(y), size, grid, key, value_key, by_value,
            mask);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// The launchers of update.h for result container A.
template <class A>
void add_rounded_for(Dtype b, Rounding rounding, Randomness randomness, const void* x,
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
void addc_rounded_for(Dtype t, bool divide, double value, Rounding rounding, Randomness randomness,
                      const void* x, const void* t1, const void* t2, void* y, int64_t n,
                      const GridSpec& grid, const RandomSpec& random, cudaStream_t stream) {
  with_operand<A>(t, [&](auto ct) {
    using TC = decltype(ct);
    const auto run = [&](auto divides) {
      using Operands = AddcOperands<A, TC, decltype(divides)::value>;
      const Operands operands{
          static_cast<const typename A::storage*>(x), static_cast<const typename TC::storage*>(t1),
          static_cast<const typename TC::storage*>(t2), static_cast<typename Operands::T>(value)};
      launch<A, typename Operands::K>(operands, rounding, randomness, y, n, grid, random, stream);
    };
    if (divide) {
      run(std::true_type{});
    } else {
      run(std::false_type{});
    }
  });
}

// The launchers' instantiations for A: `LPSIM_GPU_UPDATE_INSTANCES(, A)` defines them (one .cu
// file per container), `LPSIM_GPU_UPDATE_INSTANCES(extern, A)` keeps other files from
// instantiating them.
#define LPSIM_GPU_UPDATE_INSTANCES(prefix, A)                                                      \
  prefix template void add_rounded_for<A>(Dtype, Rounding, Randomness, const void*, const void*,   \
                                          void*, int64_t, const GridSpec&, const RandomSpec&,      \
                                          cudaStream_t);                                           \
  prefix template void addc_rounded_for<A>(Dtype, bool, double, Rounding, Randomness, const void*, \
                                           const void*, const void*, void*, int64_t,               \
                                           const GridSpec&, const RandomSpec&, cudaStream_t);

}  // namespace lpsim::gpu::update
