// The CUDA launchers for bfloat16 tensors (see kernels.cuh). One file per container, so that the
// containers' kernels compile in parallel.
#include "kernels.cuh"

namespace lpsim::gpu {
LPSIM_GPU_INSTANTIATE(BFloat16Container)
}  // namespace lpsim::gpu
