// The quantize ops: schemas (the TORCH_LIBRARY of lpsim; the other op files add fragments),
// argument checks, and the torch glue around the CPU loops (cpu/quantize.h) and the CUDA launchers
// (cuda/quantize.h).
//
// Two families of ops, each functional, in place (`_`) and with an output tensor (`_out`):
//   quantize_grid   Float and Fixed formats: one grid for every element (see round.h);
//   quantize_block  BlockFloat: a grid per block, from the block's largest finite magnitude.
// Arguments are the container-independent description that lpsim/formats.py computes.
//
// The kernels read contiguous tensors: a non-contiguous input is copied first, and a
// non-contiguous destination is written through a contiguous buffer that is copied back.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <lpsim/philox.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "block_float_op.h"
#include "checks.h"
#include "cpu/loops.h"
#include "cpu/quantize.h"
#include "dispatch.h"
#include "parallel.h"

#if defined(LPSIM_WITH_CUDA)
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/quantize.h"
#endif

namespace lpsim {
namespace {

// ---- Checks

void check_block(const at::Tensor& x, int64_t wl, std::optional<int64_t> dim,
                 std::optional<int64_t> block_size) {
  const int man = container_man_bits(container_of(x));
  TORCH_CHECK(wl >= 2 && wl <= man + 2, "lpsim: wl must be in [2, ", man + 2, "] for a ",
              x.scalar_type(), " container, got ", wl);
  TORCH_CHECK(!(dim.has_value() && block_size.has_value()),
              "lpsim: give dim or block_size, not both");
  if (dim.has_value()) {
    TORCH_CHECK_INDEX(*dim >= 0 && *dim < std::max<int64_t>(x.dim(), 1), "lpsim: dim ", *dim,
                      " does not exist in a tensor of ", x.dim(), " dimensions");
  }
  if (block_size.has_value()) {
    TORCH_CHECK(*block_size >= 1, "lpsim: block_size must be >= 1, got ", *block_size);
  }
}

// ---- The three variants of each op around a device's kernel

// A device's kernels: write x (any strides) quantised into dst (same shape and dtype, possibly x).
using GridKernel = void (*)(const at::Tensor& x, const at::Tensor& dst, const GridSpec& spec,
                            Rounding rounding, const RandomSpec& random);
using BlockKernel = void (*)(const at::Tensor& x, const at::Tensor& dst, int32_t wl,
                             const BlockLayout& layout, Rounding rounding,
                             const RandomSpec& random);

#define LPSIM_QUANTIZE_GRID_ARGS \
  LPSIM_GRID_PARAMS() int64_t rounding, int64_t rbits, const Seed &seed, int64_t offset
#define LPSIM_QUANTIZE_GRID_CALL                                                    \
  grid_spec(container_of(x), GridSpec{LPSIM_GRID_VALUES()}), rounding_of(rounding), \
      random_spec(rounding_of(rounding), rbits, seed, offset)
#define LPSIM_QUANTIZE_BLOCK_ARGS                                                              \
  int64_t wl, std::optional<int64_t> dim, std::optional<int64_t> block_size, int64_t rounding, \
      int64_t rbits, const Seed &seed, int64_t offset
#define LPSIM_QUANTIZE_BLOCK_CALL                                                        \
  static_cast<int32_t>(wl), block_layout(x, wl, dim, block_size), rounding_of(rounding), \
      random_spec(rounding_of(rounding), rbits, seed, offset)

template <GridKernel kernel>
at::Tensor quantize_grid_op(const at::Tensor& x, LPSIM_QUANTIZE_GRID_ARGS) {
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  kernel(x, y, LPSIM_QUANTIZE_GRID_CALL);
  return y;
}

template <GridKernel kernel>
void quantize_grid_inplace_op(const at::Tensor& x, LPSIM_QUANTIZE_GRID_ARGS) {
  kernel(x, x, LPSIM_QUANTIZE_GRID_CALL);
}

template <GridKernel kernel>
void quantize_grid_out_op(const at::Tensor& x, LPSIM_QUANTIZE_GRID_ARGS, const at::Tensor& out) {
  check_out(x, out);
  kernel(x, out, LPSIM_QUANTIZE_GRID_CALL);
}

template <BlockKernel kernel>
at::Tensor quantize_block_op(const at::Tensor& x, LPSIM_QUANTIZE_BLOCK_ARGS) {
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  kernel(x, y, LPSIM_QUANTIZE_BLOCK_CALL);
  return y;
}

template <BlockKernel kernel>
void quantize_block_inplace_op(const at::Tensor& x, LPSIM_QUANTIZE_BLOCK_ARGS) {
  kernel(x, x, LPSIM_QUANTIZE_BLOCK_CALL);
}

template <BlockKernel kernel>
void quantize_block_out_op(const at::Tensor& x, LPSIM_QUANTIZE_BLOCK_ARGS, const at::Tensor& out) {
  check_out(x, out);
  kernel(x, out, LPSIM_QUANTIZE_BLOCK_CALL);
}

// Register the six quantize ops of one dispatch key with its kernels.
template <GridKernel grid, BlockKernel block>
void register_quantize_ops(torch::Library& m) {
  m.impl("quantize_grid", quantize_grid_op<grid>);
  m.impl("quantize_grid_", quantize_grid_inplace_op<grid>);
  m.impl("quantize_grid_out", quantize_grid_out_op<grid>);
  m.impl("quantize_block", quantize_block_op<block>);
  m.impl("quantize_block_", quantize_block_inplace_op<block>);
  m.impl("quantize_block_out", quantize_block_out_op<block>);
}

// ---- CPU

void grid_cpu(const at::Tensor& x, const at::Tensor& dst, const GridSpec& spec, Rounding rounding,
              const RandomSpec& random) {
  const Dtype dtype = container_of(x);  // checked by grid_spec
  const at::Tensor src = x.contiguous();
  Destination out(dst);
  const void* xp = src.data_ptr();
  void* yp = out.buffer.data_ptr();
  lpsim::parallel_for(0, src.numel(), cpu::kGrain, [&](int64_t begin, int64_t end) {
    cpu::quantize_grid(dtype, rounding, xp, yp, begin, end, spec, random);
  });
  out.finish();
}

void block_cpu(const at::Tensor& x, const at::Tensor& dst, int32_t wl, const BlockLayout& layout,
               Rounding rounding, const RandomSpec& random) {
  const Dtype dtype = container_of(x);
  const at::Tensor src = x.contiguous();
  Destination out(dst);
  const void* xp = src.data_ptr();
  void* yp = out.buffer.data_ptr();
  const int64_t n = src.numel();
  if (n == 0) return out.finish();

  if (layout.by_size) {
    const int64_t grain = std::max<int64_t>(1, cpu::kGrain / layout.block_size);
    lpsim::parallel_for(0, layout.blocks(n), grain, [&](int64_t b, int64_t e) {
      cpu::quantize_blocks(dtype, rounding, xp, yp, b, e, layout.row_len, layout.block_size, wl,
                           random);
    });
    return out.finish();
  }

  const std::vector<uint64_t> class_max = block_max_abs_cpu(dtype, xp, n, layout);
  lpsim::parallel_for(0, n, cpu::kGrain, [&](int64_t begin, int64_t end) {
    cpu::quantize_block_classes(dtype, rounding, xp, yp, begin, end, layout.inner, layout.classes,
                                class_max.data(), wl, random);
  });
  out.finish();
}

// Test hook: the random words of elements [start, start + count) under (seed, offset). `kernels`
// chooses between the generator the CPU loops use (whole groups, vectorised where the CPU can,
// through cpu::WordCache) and the core's per-element definition random_word(); both must agree
// with each other and with lpsim.reference. With `kernels`, every other generator the CPU runs
// (AVX2 where AVX-512VL is chosen, the scalar loop) must give the same words of each group.
at::Tensor random_words_cpu(const at::Tensor& seed, int64_t offset, int64_t start, int64_t count,
                            bool kernels) {
  TORCH_CHECK(start >= 0 && count >= 0, "lpsim: start and count must be >= 0");
  const RandomSpec r = random_spec(Rounding::stochastic, 32, seed, offset);
  const PhiloxKey key = make_philox_key(r.seed, r.offset);
  at::Tensor words = at::empty({count}, at::TensorOptions().dtype(at::kLong));
  int64_t* w = words.data_ptr<int64_t>();
  cpu::WordCache cache(key);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t index = start + i;
    if (kernels && (i == 0 || index % kGroupSize == 0)) {
      const uint64_t group = static_cast<uint64_t>(index / kGroupSize);
      TORCH_CHECK(cpu::philox_generators_agree(group, key),
                  "lpsim: the CPU's random-word generators disagree on group ", group);
    }
    w[i] = kernels ? cache(index) : random_word(static_cast<uint64_t>(index), key);
  }
  return words;
}

// ---- CUDA: the kernels run on the input's device, on its current stream.

#if defined(LPSIM_WITH_CUDA)
cudaStream_t current_stream(const at::Tensor& x) {
  return c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
}

void grid_cuda(const at::Tensor& x, const at::Tensor& dst, const GridSpec& spec, Rounding rounding,
               const RandomSpec& random) {
  const Dtype dtype = container_of(x);  // checked by grid_spec
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
  const Dtype dtype = container_of(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor src = x.contiguous();
  Destination out(dst);
  const int64_t n = src.numel();
  if (n == 0) return out.finish();
  const cudaStream_t stream = current_stream(x);
  // Scratch for the classes' or blocks' largest magnitudes, in the container's word type.
  const auto words = [&](int64_t count) {
    const at::ScalarType word = dtype == Dtype::float64 ? at::kLong : at::kInt;
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
#endif

}  // namespace

BlockLayout block_layout(const at::Tensor& x, int64_t wl, std::optional<int64_t> dim,
                         std::optional<int64_t> block_size) {
  check_block(x, wl, dim, block_size);
  BlockLayout layout{block_size.has_value(), 1, block_size.value_or(1), 1, x.numel()};
  if (layout.by_size) {
    layout.row_len = x.dim() == 0 ? 1 : x.size(-1);
  } else if (dim.has_value() && x.dim() > 0) {
    layout.classes = x.size(*dim);
    layout.inner = 1;
    for (int64_t d = *dim + 1; d < x.dim(); ++d) layout.inner *= x.size(d);
  }
  return layout;
}

ScaledLayout block_tiles(const BlockLayout& layout, int64_t n) {
  if (layout.by_size)
    return ScaledLayout{1, n / layout.row_len, layout.row_len, 1, 1, layout.block_size};
  const int64_t cols = layout.classes * layout.inner, rows = n / cols;
  return ScaledLayout{1, rows, cols, 1, rows, layout.inner};
}

std::vector<uint64_t> block_max_abs_cpu(Dtype dtype, const void* x, int64_t n,
                                        const BlockLayout& layout) {
  if (layout.by_size) {
    std::vector<uint64_t> block_max(static_cast<size_t>(layout.blocks(n)), 0);
    const int64_t grain = std::max<int64_t>(1, cpu::kGrain / layout.block_size);
    lpsim::parallel_for(0, layout.blocks(n), grain, [&](int64_t b, int64_t e) {
      cpu::blocks_max_abs(dtype, x, b, e, layout.row_len, layout.block_size, block_max.data());
    });
    return block_max;
  }
  // Each task keeps its own running maxima; max is exact and order-free, so any split gives the
  // same result.
  const int64_t classes = layout.classes, inner = layout.inner;
  const int64_t threads = at::get_num_threads();
  std::vector<uint64_t> partial(static_cast<size_t>(threads * classes), 0);
  lpsim::parallel_for(0, n, cpu::kGrain, [&](int64_t begin, int64_t end) {
    uint64_t* mine = partial.data() + at::get_thread_num() * classes;
    cpu::max_abs_classes(dtype, x, begin, end, inner, classes, mine);
  });
  std::vector<uint64_t> class_max(static_cast<size_t>(classes), 0);
  for (int64_t t = 0; t < threads; ++t) {
    for (int64_t c = 0; c < classes; ++c) {
      class_max[c] = std::max(class_max[c], partial[t * classes + c]);
    }
  }
  return class_max;
}

// The ops that write into an argument (here and in the other op files) return nothing, not the
// written tensor as torch's own in-place and out= ops do: torch.compile functionalizes a custom
// op only when its outputs carry no alias annotation ("-> Tensor(a!)" fails there). torch's
// fallbacks for views with the negative bit and for vmap, which expect the written tensor back,
// are met in Python instead (lpsim._ops.call_in_place, lpsim.functional.quantize's out=).
TORCH_LIBRARY(lpsim, m) {
  const std::string grid = grid_schema() + ", " + kRandomSchema;
  const std::string block = std::string("int wl, int? dim, int? block_size, ") + kRandomSchema;
  const auto def = [&m](const std::string& schema) { m.def(schema.c_str()); };
  def("quantize_grid(Tensor x, " + grid + ") -> Tensor");
  def("quantize_grid_(Tensor(a!) x, " + grid + ") -> ()");
  def("quantize_grid_out(Tensor x, " + grid + ", *, Tensor(a!) out) -> ()");
  def("quantize_block(Tensor x, " + block + ") -> Tensor");
  def("quantize_block_(Tensor(a!) x, " + block + ") -> ()");
  def("quantize_block_out(Tensor x, " + block + ", *, Tensor(a!) out) -> ()");
  def("random_words(Tensor seed, int offset, int start, int count, bool kernels) -> Tensor");
}

TORCH_LIBRARY_IMPL(lpsim, CPU, m) {
  register_quantize_ops<grid_cpu, block_cpu>(m);
  m.impl("random_words", random_words_cpu);
}

#if defined(LPSIM_WITH_CUDA)
TORCH_LIBRARY_IMPL(lpsim, CUDA, m) { register_quantize_ops<grid_cuda, block_cuda>(m); }
#endif

}  // namespace lpsim
