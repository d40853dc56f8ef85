// The CUDA launchers for float64 tensors (see kernels.cuh). One file per container, so that the
// containers' kernels compile in parallel.
#include "kernels.cuh"

namespace lpsim::gpu {
LPSIM_GPU_INSTANTIATE(Float64Container)
}  // namespace lpsim::gpu
