// The quantize_scaled ops (Scaled formats, lpsim/scaled.py): schemas, argument checks, and the
// torch glue around the CPU loops (cpu/scaled.h) and the CUDA launchers (cuda/scaled.h).
// Functional, in place (`_`) and with an output tensor (`_out`), as the other quantize ops; their
// arguments are the scaled format's (scaled_op.h) and the rule's.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "checks.h"
#include "cpu/loops.h"
#include "cpu/scaled.h"
#include "parallel.h"
#include "scaled_op.h"

#if defined(LPSIM_WITH_CUDA)
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/scaled.h"
#include "dispatch.h"
#endif

namespace lpsim {

// ---- Checks

void check_scaled_block(int64_t dims, at::IntArrayRef block, std::optional<int64_t> axis) {
  for (const int64_t b : block) TORCH_CHECK(b >= 1, "lpsim: block sizes must be >= 1, got ", b);
  if (!axis.has_value()) {
    TORCH_CHECK(block.empty() || block.size() == 2,
                "lpsim: block without an axis must be [] or [rows, cols], got ", block.size(),
                " sizes");
    return;
  }
  const int64_t nd = std::max<int64_t>(dims, 1);
  TORCH_CHECK_INDEX(*axis >= -nd && *axis < nd, "lpsim: axis must be in [", -nd, ", ", nd - 1,
                    "] for a tensor of ", dims, " dimensions, got ", *axis);
  TORCH_CHECK(block.size() <= 1, "lpsim: block with an axis must be [] or [n], got ", block.size(),
              " sizes");
}

ScaledLayout scaled_layout(const at::Tensor& x, at::IntArrayRef block,
                           std::optional<int64_t> axis) {
  check_scaled_block(x.dim(), block, axis);
  std::vector<int64_t> dims = x.sizes().vec();
  if (dims.empty()) dims.push_back(1);
  const auto product = [&](size_t begin, size_t end) {
    int64_t p = 1;
    for (size_t d = begin; d < end; ++d) p *= dims[d];
    return p;
  };
  const int64_t n = x.numel();
  if (!axis.has_value()) {
    if (block.empty()) return ScaledLayout{1, 1, n, 1, 1, std::max<int64_t>(n, 1)};
    if (dims.size() == 1) dims.insert(dims.begin(), 1);
    const size_t nd = dims.size();
    return ScaledLayout{product(0, nd - 2), dims[nd - 2], dims[nd - 1], 1, block[0], block[1]};
  }
  const int64_t nd = static_cast<int64_t>(dims.size());
  const size_t d = static_cast<size_t>(*axis < 0 ? *axis + nd : *axis);
  const int64_t length = dims[d];
  const int64_t tile = block.empty() ? std::max<int64_t>(length, 1) : block[0];
  return ScaledLayout{product(0, d), 1, length, product(d + 1, dims.size()), 1, tile};
}

static Dtype arithmetic_of(Dtype dtype) {
  return dtype == Dtype::float64 ? Dtype::float64 : Dtype::float32;
}

ScaledSpec scaled_spec(const at::Tensor& x, const GridSpec& element, const GridSpec& scale,
                       int64_t scale_rule, bool tensor_scale, int64_t element_emax,
                       int64_t element_precision, double element_max) {
  const Dtype dtype = container_of(x);
  TORCH_CHECK(scale_rule >= 0 && scale_rule <= static_cast<int64_t>(ScaleRule::amax),
              "lpsim: scale_rule must be in [0, 4], got ", scale_rule);
  const auto rule = static_cast<ScaleRule>(scale_rule);
  TORCH_CHECK(!tensor_scale || rule == ScaleRule::amax,
              "lpsim: tensor_scale needs the amax scale rule (a Float scale)");
  TORCH_CHECK(element_emax > -1100 && element_emax < 1100, "lpsim: element_emax out of range");
  TORCH_CHECK(element_precision >= 0 && element_precision < 1100,
              "lpsim: element_precision must be in [0, 1100), got ", element_precision);
  TORCH_CHECK(element_max > 0 && element_max < 1e300, "lpsim: element_max must be positive, got ",
              element_max);
  TORCH_CHECK(scale.pos_limit > 0 && scale.pos_limit < 0x1p128 && scale.emin >= -149,
              "lpsim: the scale's range must lie within float32's, got largest ", scale.pos_limit,
              " and smallest exponent ", scale.emin);
  ScaledSpec s;
  s.rule = rule;
  // The elements must fit x's container (so that decoded values do), and are rounded in float64.
  grid_spec(dtype, element);
  s.element = grid_spec(Dtype::float64, element);
  s.element_emax = static_cast<int32_t>(element_emax);
  s.element_precision = static_cast<int32_t>(element_precision);
  s.element_max = element_max;
  s.scale = grid_spec(arithmetic_of(dtype), scale);
  s.two_level = tensor_scale;
  s.tensor = s.tensor_reciprocal = 1;
  return s;
}

// ---- The CPU scan of the scales

// A group's elements are scanned for their largest magnitudes and rounded in one task while they
// stay in cache: at most this many elements (a task takes a slice of the inner indices to stay
// below it). Groups with more positions than this are scanned in chunks first, then rounded.
constexpr int64_t kFusedElements = 1 << 15;

void set_tensor_scale_cpu(Dtype dtype, const void* x, int64_t n, ScaledSpec& spec) {
  // The maximum is exact and order-free: any split of the work gives the same tensor scale.
  std::vector<uint64_t> partial(static_cast<size_t>(at::get_num_threads()), 0);
  lpsim::parallel_for(0, n, cpu::kGrain, [&](int64_t begin, int64_t end) {
    cpu::max_abs_bits(dtype, x, begin, end, &partial[at::get_thread_num()]);
  });
  cpu::set_tensor_scale(dtype, spec, *std::max_element(partial.begin(), partial.end()));
}

int64_t scan_chunk(const ScaledLayout& layout) {
  return std::max<int64_t>(1, kFusedElements / layout.inner);
}

std::vector<BlockScale> block_scales_cpu(Dtype dtype, const void* x, const ScaledLayout& layout,
                                         const ScaledSpec& spec) {
  const int64_t chunk = scan_chunk(layout);
  const int64_t groups = layout.groups(), inner = layout.inner;
  const int64_t positions = layout.positions();
  const int64_t chunks = (positions + chunk - 1) / chunk;
  std::vector<uint64_t> amax(static_cast<size_t>(groups * inner), 0);
  if (chunks == 1) {  // whole groups per task, many at a time where they are small
    const int64_t grain = std::max<int64_t>(1, cpu::kGrain / (positions * inner));
    lpsim::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
      cpu::scaled_groups_max_abs(dtype, x, layout, begin, end, amax.data());
    });
  } else {  // chunks of a group's positions, whose maxima are then combined
    std::vector<uint64_t> partial(static_cast<size_t>(groups * chunks * inner), 0);
    lpsim::parallel_for(0, groups * chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t g = task / chunks, p0 = task % chunks * chunk;
        cpu::scaled_max_abs(dtype, x, layout, g, p0, p0 + chunk, 0, inner,
                            partial.data() + task * inner);
      }
    });
    for (int64_t task = 0; task < groups * chunks; ++task) {
      uint64_t* group_max = amax.data() + task / chunks * inner;
      for (int64_t i = 0; i < inner; ++i) {
        group_max[i] = std::max(group_max[i], partial[task * inner + i]);
      }
    }
  }
  std::vector<BlockScale> scales(static_cast<size_t>(groups * inner));
  cpu::block_scales(dtype, spec, amax.data(), groups * inner, scales.data());
  return scales;
}

namespace {

// ---- The three variants around a device's kernel

using ScaledKernel = void (*)(const at::Tensor& x, const at::Tensor& dst, ScaledSpec spec,
                              const ScaledLayout& layout, Rounding rounding,
                              const RandomSpec& random);

#define LPSIM_QUANTIZE_SCALED_ARGS \
  LPSIM_SCALED_FORMAT_PARAMS int64_t rounding, int64_t rbits, const Seed &seed, int64_t offset
#define LPSIM_QUANTIZE_SCALED_CALL                                                \
  LPSIM_SCALED_FORMAT_SPEC, scaled_layout(x, block, axis), rounding_of(rounding), \
      random_spec(rounding_of(rounding), rbits, seed, offset)

template <ScaledKernel kernel>
at::Tensor quantize_scaled_op(const at::Tensor& x, LPSIM_QUANTIZE_SCALED_ARGS) {
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  kernel(x, y, LPSIM_QUANTIZE_SCALED_CALL);
  return y;
}

template <ScaledKernel kernel>
void quantize_scaled_inplace_op(const at::Tensor& x, LPSIM_QUANTIZE_SCALED_ARGS) {
  kernel(x, x, LPSIM_QUANTIZE_SCALED_CALL);
}

template <ScaledKernel kernel>
void quantize_scaled_out_op(const at::Tensor& x, LPSIM_QUANTIZE_SCALED_ARGS,
                            const at::Tensor& out) {
  check_out(x, out);
  kernel(x, out, LPSIM_QUANTIZE_SCALED_CALL);
}

template <ScaledKernel kernel>
void register_scaled_ops(torch::Library& m) {
  m.impl("quantize_scaled", quantize_scaled_op<kernel>);
  m.impl("quantize_scaled_", quantize_scaled_inplace_op<kernel>);
  m.impl("quantize_scaled_out", quantize_scaled_out_op<kernel>);
}

// ---- Meta: what torch.compile traces with (shapes only, so no check that reads x's sizes or the
// seed's value): the result's shape and dtype, and the (block, axis) checks, so that a compiled
// call raises what the eager one raises.

at::Tensor quantize_scaled_meta(const at::Tensor& x, LPSIM_QUANTIZE_SCALED_ARGS) {
  check_scaled_block(x.dim(), block, axis);
  return at::empty_like(x, at::MemoryFormat::Contiguous);
}

void quantize_scaled_inplace_meta(const at::Tensor& x, LPSIM_QUANTIZE_SCALED_ARGS) {
  check_scaled_block(x.dim(), block, axis);
}

void quantize_scaled_out_meta(const at::Tensor& x, LPSIM_QUANTIZE_SCALED_ARGS,
                              const at::Tensor& out) {
  check_scaled_block(x.dim(), block, axis);
}

// ---- CPU

void scaled_cpu(const at::Tensor& x, const at::Tensor& dst, ScaledSpec spec,
                const ScaledLayout& layout, Rounding rounding, const RandomSpec& random) {
  const Dtype dtype = container_of(x);
  const at::Tensor src = x.contiguous();
  Destination out(dst);
  const int64_t n = src.numel();
  if (n == 0) return out.finish();
  const IeeeSubnormals mode;  // the tensor's and the blocks' scales, computed on this thread
  const void* xp = src.data_ptr();
  void* yp = out.buffer.data_ptr();

  if (spec.two_level) set_tensor_scale_cpu(dtype, xp, n, spec);

  const int64_t groups = layout.groups(), inner = layout.inner;
  const int64_t positions = layout.positions();

  if (positions <= kFusedElements) {
    // Tasks of one group and a slice of `width` inner indices, scanned and rounded in cache.
    const int64_t width = std::clamp<int64_t>(kFusedElements / positions, 1, inner);
    const int64_t slices = (inner + width - 1) / width;
    const int64_t grain = std::max<int64_t>(1, cpu::kGrain / (positions * width));
    const cpu::ScaledTasks tasks{width, slices, positions, 1};
    lpsim::parallel_for(0, groups * slices, grain, [&](int64_t begin, int64_t end) {
      cpu::scaled_quantize(dtype, rounding, xp, yp, layout, tasks, begin, end, spec, random,
                           nullptr);
    });
    return out.finish();
  }

  // Large groups: chunks of positions, scanned in parallel, then rounded in parallel.
  const int64_t chunk = scan_chunk(layout);
  const int64_t chunks = (positions + chunk - 1) / chunk;
  const std::vector<BlockScale> scales = block_scales_cpu(dtype, xp, layout, spec);
  const cpu::ScaledTasks tasks{inner, 1, chunk, chunks};
  lpsim::parallel_for(0, groups * chunks, 1, [&](int64_t begin, int64_t end) {
    cpu::scaled_quantize(dtype, rounding, xp, yp, layout, tasks, begin, end, spec, random,
                         scales.data());
  });
  out.finish();
}

// ---- CUDA: the kernels run on the input's device, on its current stream.

#if defined(LPSIM_WITH_CUDA)
void scaled_cuda(const at::Tensor& x, const at::Tensor& dst, ScaledSpec spec,
                 const ScaledLayout& layout, Rounding rounding, const RandomSpec& random) {
  const Dtype dtype = container_of(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor src = x.contiguous();
  Destination out(dst);
  const int64_t n = src.numel();
  if (n == 0) return out.finish();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  // Scratch: each block's largest magnitude bits and, last, the tensor's; then the blocks' scales.
  const int64_t blocks = layout.blocks();
  const at::Tensor amax = at::zeros({blocks + 1}, src.options().dtype(at::kLong));
  const at::Tensor scales = at::empty({blocks * static_cast<int64_t>(sizeof(BlockScale))},
                                      src.options().dtype(at::kByte));
  with_container(dtype, [&](auto container) {
    using C = decltype(container);
    gpu::quantize_scaled<C>(rounding, src.const_data_ptr(), out.buffer.data_ptr(), n, layout, spec,
                            amax.data_ptr(), scales.data_ptr(), random, stream);
  });
  out.finish();
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(lpsim, m) {
  const std::string args = scaled_format_schema() + ", " + kRandomSchema;
  const auto def = [&m](const std::string& schema) { m.def(schema.c_str()); };
  def("quantize_scaled(Tensor x, " + args + ") -> Tensor");
  def("quantize_scaled_(Tensor(a!) x, " + args + ") -> ()");
  def("quantize_scaled_out(Tensor x, " + args + ", *, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(lpsim, CPU, m) { register_scaled_ops<scaled_cpu>(m); }

TORCH_LIBRARY_IMPL(lpsim, Meta, m) {
  m.impl("quantize_scaled", quantize_scaled_meta);
  m.impl("quantize_scaled_", quantize_scaled_inplace_meta);
  m.impl("quantize_scaled_out", quantize_scaled_out_meta);
}

#if defined(LPSIM_WITH_CUDA)
TORCH_LIBRARY_IMPL(lpsim, CUDA, m) { register_scaled_ops<scaled_cuda>(m); }
#endif

}  // namespace lpsim
