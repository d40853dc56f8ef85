// The CUDA launchers for bfloat16 tensors (see quantize.cuh). One file per container, so that the
// containers' kernels compile in parallel.
#include "cuda/quantize.cuh"

namespace lpsim::gpu {
LPSIM_GPU_INSTANTIATE(BFloat16Container)
}  // namespace lpsim::gpu
