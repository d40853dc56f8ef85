// The CUDA kernels of the update ops (schemas, checks and op variants in arith_ops.{h,cpp}). The
// kernels run on a's device, on its current stream, over contiguous tensors.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "arith_ops.h"
#include "cuda/arith_kernels.h"

namespace lpsim {
namespace {

cudaStream_t stream_of(const at::Tensor& a) {
  return c10::cuda::getCurrentCUDAStream(a.device().index()).stream();
}

void add_kernel_cuda(const at::Tensor& a, const Update& u) {
  const c10::cuda::CUDAGuard guard(a.device());
  gpu::add_rounded(u.a, u.operand, u.rounding, u.randomness, u.x, u.b, u.y, u.n, u.grid, u.random,
                   stream_of(a));
}

void addc_kernel_cuda(const at::Tensor& a, const Update& u) {
  const c10::cuda::CUDAGuard guard(a.device());
  gpu::addc_rounded(u.a, u.operand, u.divide, u.value, u.rounding, u.randomness, u.x, u.t1, u.t2,
                    u.y, u.n, u.grid, u.random, stream_of(a));
}

}  // namespace

TORCH_LIBRARY_IMPL(lpsim, CUDA, m) {
  register_update_ops<add_kernel_cuda, addc_kernel_cuda>(m);
}

}  // namespace lpsim
