// The CUDA launchers of the update ops (arith_kernels.h): dispatch on the result's container to the
// instantiations in arith_<container>.cu.
#include "cuda/arith_update.cuh"

#include "dispatch.h"

namespace lpsim::gpu {

namespace arith {
LPSIM_GPU_ARITH_INSTANCES(extern, Float32Container)
LPSIM_GPU_ARITH_INSTANCES(extern, Float64Container)
LPSIM_GPU_ARITH_INSTANCES(extern, BFloat16Container)
LPSIM_GPU_ARITH_INSTANCES(extern, Float16Container)
}  // namespace arith

void add_rounded(cpu::Dtype a, cpu::Dtype b, Rounding rounding, cpu::Randomness randomness,
                 const void* x, const void* bv, void* y, int64_t n, const GridSpec& grid,
                 const RandomSpec& random, cudaStream_t stream) {
  with_container(a, [&](auto ca) {
    arith::add_rounded_for<decltype(ca)>(b, rounding, randomness, x, bv, y, n, grid, random,
                                         stream);
  });
}

void addc_rounded(cpu::Dtype a, cpu::Dtype t, bool divide, double value, Rounding rounding,
                  cpu::Randomness randomness, const void* x, const void* t1, const void* t2,
                  void* y, int64_t n, const GridSpec& grid, const RandomSpec& random,
                  cudaStream_t stream) {
  with_container(a, [&](auto ca) {
    arith::addc_rounded_for<decltype(ca)>(t, divide, value, rounding, randomness, x, t1, t2, y, n,
                                          grid, random, stream);
  });
}

}  // namespace lpsim::gpu
