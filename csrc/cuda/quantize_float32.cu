// The CUDA launchers for float32 tensors (see kernels.cuh). One file per container, so that the
// containers' kernels compile in parallel.
#include "kernels.cuh"

namespace lpsim::gpu {
LPSIM_GPU_INSTANTIATE(Float32Container)
}  // namespace lpsim::gpu
