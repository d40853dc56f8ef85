// The CUDA update kernels for float16 results (see arith_update.cuh). One file per container, so
// that the containers' kernels compile in parallel.
#include "cuda/arith_update.cuh"

namespace lpsim::gpu::arith {
LPSIM_GPU_ARITH_INSTANCES(, Float16Container)
}  // namespace lpsim::gpu::arith
