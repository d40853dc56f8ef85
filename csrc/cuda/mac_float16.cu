// The mac_matmul launcher for float16 operands (see mac.cuh). One file per container, so that the
// containers' kernels compile in parallel.
#include "cuda/mac.cuh"

namespace lpsim::gpu {
LPSIM_GPU_INSTANTIATE_MAC(Float16Container)
}  // namespace lpsim::gpu
