// The CUDA kernels of the lpsim ops (schemas and CPU kernels in ops.cpp; the op variants and
// argument checks they share in ops.h).
//
// The kernels run on the input's device, on its current stream, over contiguous tensors: a
// non-contiguous input is copied first, and a non-contiguous destination is written through a
// contiguous buffer that is copied back, as on the CPU.
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/kernels.h"
#include "dispatch.h"
#include "ops.h"

namespace lpsim {
namespace {

cudaStream_t current_stream(const at::Tensor& x) {
  return c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
}

void grid_cuda(const at::Tensor& x, const at::Tensor& dst, const GridSpec& spec, Rounding rounding,
               const RandomSpec& random) {
  const cpu::Dtype dtype = container_of(x);  // checked by grid_spec
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor src = x.contiguous();
  Destination out(dst);
  const int64_t n = src.numel();
  if (n > 0) {
    with_container(dtype, [&](auto container) {
      using C = decltype(container);
      gpu::quantize_grid<C>(rounding, src.const_data_ptr(), out.buffer.data_ptr(), n, spec, random,
                            current_stream(x));
    });
  }
  out.finish();
}

void block_cuda(const at::Tensor& x, const at::Tensor& dst, int32_t wl, const BlockLayout& layout,
                Rounding rounding, const RandomSpec& random) {
  const cpu::Dtype dtype = container_of(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor src = x.contiguous();
  Destination out(dst);
  const int64_t n = src.numel();
  if (n == 0) return out.finish();
  const cudaStream_t stream = current_stream(x);
  // Scratch for the classes' or blocks' largest magnitudes, in the container's word type.
  const auto words = [&](int64_t count) {
    const at::ScalarType word = dtype == cpu::Dtype::float64 ? at::kLong : at::kInt;
    return at::zeros({count}, src.options().dtype(word));
  };

  if (layout.by_size) {
    const int64_t scratch_words = gpu::block_scratch_words(n, layout.row_len, layout.block_size);
    const at::Tensor scratch = scratch_words > 0 ? words(scratch_words) : at::Tensor();
    with_container(dtype, [&](auto container) {
      using C = decltype(container);
      gpu::quantize_blocks<C>(rounding, src.const_data_ptr(), out.buffer.data_ptr(), n,
                              layout.row_len, layout.block_size,
                              scratch.defined() ? scratch.data_ptr() : nullptr, wl, random, stream);
    });
    return out.finish();
  }

  const at::Tensor class_max = words(layout.classes);
  with_container(dtype, [&](auto container) {
    using C = decltype(container);
    gpu::quantize_block_classes<C>(rounding, src.const_data_ptr(), out.buffer.data_ptr(), n,
                                   layout.inner, layout.classes, class_max.data_ptr(), wl, random,
                                   stream);
  });
  out.finish();
}

}  // namespace

TORCH_LIBRARY_IMPL(lpsim, CUDA, m) {
  register_quantize_ops<grid_cuda, block_cuda>(m);
}

}  // namespace lpsim
