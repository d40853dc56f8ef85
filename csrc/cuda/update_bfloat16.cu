// The CUDA update kernels for bfloat16 results (see update.cuh). One file per container, so
// that the containers' kernels compile in parallel.
#include "cuda/update.cuh"

namespace lpsim::gpu::update {
LPSIM_GPU_UPDATE_INSTANCES(, BFloat16Container)
}  // namespace lpsim::gpu::update
