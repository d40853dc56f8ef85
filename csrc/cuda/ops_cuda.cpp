// The CUDA implementations of the lpsim ops (schemas and CPU implementations in ops.cpp).
//
// Arguments are checked by the functions the CPU ops use (ops.h). The kernels run on the input's
// device, on its current stream, over contiguous tensors: a non-contiguous input is copied first,
// and a non-contiguous destination is written through a contiguous buffer that is copied back, as
// on the CPU.
#include <ATen/core/Tensor.h>
#include <ATen/ops/copy.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>

#include "cuda/kernels.h"
#include "ops.h"

namespace lpsim {
namespace {

// The output tensor a kernel writes: `dst` itself when it is contiguous, else a temporary that
// finish() copies back.
struct Destination {
  at::Tensor target;
  at::Tensor buffer;

  explicit Destination(const at::Tensor& dst)
      : target(dst),
        buffer(dst.is_contiguous() ? dst : at::empty_like(dst, at::MemoryFormat::Contiguous)) {}
  void finish() {
    if (!buffer.is_same(target)) target.copy_(buffer);
  }
};

// Call f(C{}) for the container C of the run-time dtype.
template <class F>
void with_container(cpu::Dtype d, F&& f) {
  switch (d) {
    case cpu::Dtype::float32: return f(Float32Container{});
    case cpu::Dtype::float64: return f(Float64Container{});
    case cpu::Dtype::bfloat16: return f(BFloat16Container{});
    case cpu::Dtype::float16: return f(Float16Container{});
  }
}

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

void block_cuda(const at::Tensor& x, const at::Tensor& dst, int64_t wl, std::optional<int64_t> dim,
                std::optional<int64_t> block_size, Rounding rounding, const RandomSpec& random) {
  const cpu::Dtype dtype = container_of(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor src = x.contiguous();
  Destination out(dst);
  const int64_t n = src.numel();
  if (n == 0) return out.finish();
  const int32_t bits = static_cast<int32_t>(wl);
  const cudaStream_t stream = current_stream(x);
  // Scratch for the classes' or blocks' largest magnitudes, in the container's word type.
  const auto words = [&](int64_t count) {
    const at::ScalarType word = dtype == cpu::Dtype::float64 ? at::kLong : at::kInt;
    return at::zeros({count}, src.options().dtype(word));
  };

  if (block_size.has_value()) {
    const int64_t row_len = src.dim() == 0 ? 1 : src.size(-1);
    const int64_t scratch_words = gpu::block_scratch_words(n, row_len, *block_size);
    const at::Tensor scratch = scratch_words > 0 ? words(scratch_words) : at::Tensor();
    with_container(dtype, [&](auto container) {
      using C = decltype(container);
      gpu::quantize_blocks<C>(rounding, src.const_data_ptr(), out.buffer.data_ptr(), n, row_len,
                              *block_size, scratch.defined() ? scratch.data_ptr() : nullptr, bits,
                              random, stream);
    });
    return out.finish();
  }

  // One exponent for the whole tensor (one class), or one per index along dim.
  int64_t classes = 1, inner = n;
  if (dim.has_value() && src.dim() > 0) {
    classes = src.size(*dim);
    inner = 1;
    for (int64_t d = *dim + 1; d < src.dim(); ++d) inner *= src.size(d);
  }
  const at::Tensor class_max = words(classes);
  with_container(dtype, [&](auto container) {
    using C = decltype(container);
    gpu::quantize_block_classes<C>(rounding, src.const_data_ptr(), out.buffer.data_ptr(), n, inner,
                                   classes, class_max.data_ptr(), bits, random, stream);
  });
  out.finish();
}

#define LPSIM_GRID_ARGS                                                                          \
  int64_t keep, int64_t qmin, int64_t emin, bool subnormals, double pos_limit, double neg_limit, \
      bool saturate, bool has_inf, bool unsigned_zero, int64_t rounding, int64_t rbits,          \
      const at::Tensor &seed, int64_t offset
#define LPSIM_GRID_CALL                                                                  \
  grid_spec(container_of(x), keep, qmin, emin, subnormals, pos_limit, neg_limit, saturate, \
            has_inf, unsigned_zero),                                                       \
      rounding_of(rounding), random_spec(rbits, seed, offset)

at::Tensor quantize_grid_cuda(const at::Tensor& x, LPSIM_GRID_ARGS) {
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  grid_cuda(x, y, LPSIM_GRID_CALL);
  return y;
}

void quantize_grid_inplace_cuda(const at::Tensor& x, LPSIM_GRID_ARGS) {
  grid_cuda(x, x, LPSIM_GRID_CALL);
}

void quantize_grid_out_cuda(const at::Tensor& x, LPSIM_GRID_ARGS, const at::Tensor& out) {
  check_out(x, out);
  grid_cuda(x, out, LPSIM_GRID_CALL);
}

#define LPSIM_BLOCK_ARGS                                                                       \
  int64_t wl, std::optional<int64_t> dim, std::optional<int64_t> block_size, int64_t rounding, \
      int64_t rbits, const at::Tensor &seed, int64_t offset

at::Tensor quantize_block_cuda(const at::Tensor& x, LPSIM_BLOCK_ARGS) {
  check_block(x, wl, dim, block_size);
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  block_cuda(x, y, wl, dim, block_size, rounding_of(rounding), random_spec(rbits, seed, offset));
  return y;
}

void quantize_block_inplace_cuda(const at::Tensor& x, LPSIM_BLOCK_ARGS) {
  check_block(x, wl, dim, block_size);
  block_cuda(x, x, wl, dim, block_size, rounding_of(rounding), random_spec(rbits, seed, offset));
}

void quantize_block_out_cuda(const at::Tensor& x, LPSIM_BLOCK_ARGS, const at::Tensor& out) {
  check_block(x, wl, dim, block_size);
  check_out(x, out);
  block_cuda(x, out, wl, dim, block_size, rounding_of(rounding), random_spec(rbits, seed, offset));
}

}  // namespace

TORCH_LIBRARY_IMPL(lpsim, CUDA, m) {
  m.impl("quantize_grid", quantize_grid_cuda);
  m.impl("quantize_grid_", quantize_grid_inplace_cuda);
  m.impl("quantize_grid_out", quantize_grid_out_cuda);
  m.impl("quantize_block", quantize_block_cuda);
  m.impl("quantize_block_", quantize_block_inplace_cuda);
  m.impl("quantize_block_out", quantize_block_out_cuda);
}

}  // namespace lpsim
