// What the CPU and CUDA op implementations share: argument checking, the tensors a kernel reads
// and writes, the layout of block formats, and the three variants of each op (functional, in
// place, out=) around a device's kernels.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/copy.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <optional>

#include <lpsim/grid_spec.h>

#include "cpu/kernels.h"

namespace lpsim {

// Argument checks (ops.cpp). Each raises a torch error naming the argument and its range.
cpu::Dtype container_of(const at::Tensor& x);                 // TypeError for other dtypes
int container_man_bits(cpu::Dtype dtype);
GridSpec grid_spec(cpu::Dtype dtype, int64_t keep, int64_t qmin, int64_t emin, bool subnormals,
                   double pos_limit, double neg_limit, bool saturate, bool has_inf,
                   bool unsigned_zero);                       // checked against the container
Rounding rounding_of(int64_t code);
RandomSpec random_spec(int64_t rbits, const at::Tensor& seed, int64_t offset);
void check_block(const at::Tensor& x, int64_t wl, std::optional<int64_t> dim,
                 std::optional<int64_t> block_size);
void check_out(const at::Tensor& x, const at::Tensor& out);

// The output tensor a kernel writes: `dst` itself when it is contiguous, else a contiguous
// temporary that finish() copies back.
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

// Which elements of a (contiguous) tensor share an exponent in a BlockFloat format.
struct BlockLayout {
  bool by_size;        // blocks of block_size consecutive elements along rows of row_len
  int64_t row_len;     // by_size: the size of the last dimension
  int64_t block_size;  // by_size
  int64_t classes;     // otherwise: element i takes exponent number (i / inner) % classes
  int64_t inner;       //   (one class: the whole tensor; one per index along dim)
};

// The layout of BlockFloat(wl, dim, block_size) in x, after checking the arguments.
BlockLayout block_layout(const at::Tensor& x, int64_t wl, std::optional<int64_t> dim,
                         std::optional<int64_t> block_size);

// A device's kernels: write x (any strides) quantised into dst (same shape and dtype, possibly x).
using GridKernel = void (*)(const at::Tensor& x, const at::Tensor& dst, const GridSpec& spec,
                            Rounding rounding, const RandomSpec& random);
using BlockKernel = void (*)(const at::Tensor& x, const at::Tensor& dst, int32_t wl,
                             const BlockLayout& layout, Rounding rounding, const RandomSpec& random);

#define LPSIM_GRID_ARGS                                                                          \
  int64_t keep, int64_t qmin, int64_t emin, bool subnormals, double pos_limit, double neg_limit, \
      bool saturate, bool has_inf, bool unsigned_zero, int64_t rounding, int64_t rbits,          \
      const at::Tensor &seed, int64_t offset
#define LPSIM_GRID_CALL                                                                  \
  grid_spec(container_of(x), keep, qmin, emin, subnormals, pos_limit, neg_limit, saturate, \
            has_inf, unsigned_zero),                                                       \
      rounding_of(rounding), random_spec(rbits, seed, offset)
#define LPSIM_BLOCK_ARGS                                                                       \
  int64_t wl, std::optional<int64_t> dim, std::optional<int64_t> block_size, int64_t rounding, \
      int64_t rbits, const at::Tensor &seed, int64_t offset
#define LPSIM_BLOCK_CALL                                                            \
  static_cast<int32_t>(wl), block_layout(x, wl, dim, block_size), rounding_of(rounding), \
      random_spec(rbits, seed, offset)

template <GridKernel kernel>
at::Tensor quantize_grid_op(const at::Tensor& x, LPSIM_GRID_ARGS) {
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  kernel(x, y, LPSIM_GRID_CALL);
  return y;
}

template <GridKernel kernel>
void quantize_grid_inplace_op(const at::Tensor& x, LPSIM_GRID_ARGS) {
  kernel(x, x, LPSIM_GRID_CALL);
}

template <GridKernel kernel>
void quantize_grid_out_op(const at::Tensor& x, LPSIM_GRID_ARGS, const at::Tensor& out) {
  check_out(x, out);
  kernel(x, out, LPSIM_GRID_CALL);
}

template <BlockKernel kernel>
at::Tensor quantize_block_op(const at::Tensor& x, LPSIM_BLOCK_ARGS) {
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  kernel(x, y, LPSIM_BLOCK_CALL);
  return y;
}

template <BlockKernel kernel>
void quantize_block_inplace_op(const at::Tensor& x, LPSIM_BLOCK_ARGS) {
  kernel(x, x, LPSIM_BLOCK_CALL);
}

template <BlockKernel kernel>
void quantize_block_out_op(const at::Tensor& x, LPSIM_BLOCK_ARGS, const at::Tensor& out) {
  check_out(x, out);
  kernel(x, out, LPSIM_BLOCK_CALL);
}

// Register the six quantize ops of one dispatch key (TORCH_LIBRARY_IMPL) with its kernels.
template <GridKernel grid, BlockKernel block>
void register_quantize_ops(torch::Library& m) {
  m.impl("quantize_grid", quantize_grid_op<grid>);
  m.impl("quantize_grid_", quantize_grid_inplace_op<grid>);
  m.impl("quantize_grid_out", quantize_grid_out_op<grid>);
  m.impl("quantize_block", quantize_block_op<block>);
  m.impl("quantize_block_", quantize_block_inplace_op<block>);
  m.impl("quantize_block_out", quantize_block_out_op<block>);
}

}  // namespace lpsim
