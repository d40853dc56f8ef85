// The CUDA launchers of the update ops (update.h): dispatch on the result's container to the
// instantiations in update_<container>.cu.
#include "cuda/update.cuh"
#include "dispatch.h"

namespace lpsim::gpu {

namespace update {
LPSIM_GPU_UPDATE_INSTANCES(extern, Float32Container)
LPSIM_GPU_UPDATE_INSTANCES(extern, Float64Container)
LPSIM_GPU_UPDATE_INSTANCES(extern, BFloat16Container)
LPSIM_GPU_UPDATE_INSTANCES(extern, Float16Container)
}  // namespace update

void add_rounded(Dtype a, Dtype b, Rounding rounding, Randomness randomness, const void* x,
                 const void* bv, void* y, int64_t n, const GridSpec& grid, const RandomSpec& random,
                 cudaStream_t stream) {
  with_container(a, [&](auto ca) {
    update::add_rounded_for<decltype(ca)>(b, rounding, randomness, x, bv, y, n, grid, random,
                                          stream);
  });
}

void addc_rounded(Dtype a, Dtype t, bool divide, double value, Rounding rounding,
                  Randomness randomness, const void* x, const void* t1, const void* t2, void* y,
                  int64_t n, const GridSpec& grid, const RandomSpec& random, cudaStream_t stream) {
  with_container(a, [&](auto ca) {
    update::addc_rounded_for<decltype(ca)>(t, divide, value, rounding, randomness, x, t1, t2, y, n,
                                           grid, random, stream);
  });
}

}  // namespace lpsim::gpu
