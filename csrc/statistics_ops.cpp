// The statistics ops: schemas, argument checks and the torch glue around the CPU loops
// (cpu/statistics.h) and the CUDA launcher (cuda/statistics.h).
//
//   rounding_statistics(x, rounded, low, high, smallest_normal) -> (counts, sums)
//   quantize_grid_statistics(x, <grid>, <rule and random>, low, high, smallest_normal)
//       -> (y, counts, sums): quantize_grid's y, and the statistics of the rounding
//   scaled_rounding_statistics(x, rounded, <scaled format>, element_smallest_normal)
//       -> (counts, sums): x rounded into a scaled format (scaled_op.h), each element counted
//       within its block's bounds (lpsim/scaled_statistics.h), the scales found from x again
//   block_rounding_statistics(x, rounded, wl, dim, block_size) -> (counts, sums): x rounded into
//       BlockFloat(wl, dim, block_size) (block_float_op.h), each element counted within its
//       block's bounds (lpsim/block_statistics.h), the exponents found from x again
//
// counts: int64 [elements, nonfinite, overflow, underflow, subnormal, unchanged]; sums: float64
// [squared_error, squared_value] (lpsim/rounding_statistics.h defines them and fixes the order of
// the sums). Both are CPU tensors whatever x's device: they are read by the host.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <lpsim/rounding_statistics.h>
#include <lpsim/scaled.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "block_float_op.h"
#include "checks.h"
#include "cpu/scaled.h"
#include "cpu/statistics.h"
#include "dispatch.h"
#include "parallel.h"
#include "scaled_op.h"

#if defined(LPSIM_WITH_CUDA)
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/quantize.h"
#include "cuda/scaled.h"
#include "cuda/statistics.h"
#endif

namespace lpsim {
namespace {

using Counts = std::tuple<at::Tensor, at::Tensor>;
using RoundedCounts = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

StatisticsBounds statistics_bounds(double low, double high, double smallest_normal) {
  TORCH_CHECK(!std::isnan(low) && !std::isnan(high) && low <= high,
              "lpsim: low and high must satisfy low <= high, got ", low, " and ", high);
  TORCH_CHECK(smallest_normal >= 0, "lpsim: smallest_normal must be >= 0, got ", smallest_normal);
  return StatisticsBounds{low, high, smallest_normal};
}

void check_rounded(const at::Tensor& x, const at::Tensor& rounded) {
  TORCH_CHECK(x.sizes() == rounded.sizes(), "lpsim: rounded must have x's shape ", x.sizes(),
              ", got ", rounded.sizes());
  TORCH_CHECK(x.scalar_type() == rounded.scalar_type(), "lpsim: rounded must have x's dtype ",
              x.scalar_type(), ", got ", rounded.scalar_type());
  TORCH_CHECK(x.device() == rounded.device(), "lpsim: rounded must be on x's device ", x.device(),
              ", got ", rounded.device());
}

void check_element_smallest_normal(double element_smallest_normal) {
  TORCH_CHECK(element_smallest_normal >= 0 && element_smallest_normal < INFINITY,
              "lpsim: element_smallest_normal must be >= 0 and finite, got ",
              element_smallest_normal);
}

int64_t chunk_count(int64_t n) { return (n + kStatisticsChunk - 1) / kStatisticsChunk; }

Counts as_tensors(const ChunkStatistics& total) {
  at::Tensor counts = at::empty({kStatisticsCounts}, at::TensorOptions().dtype(at::kLong));
  for (int k = 0; k < kStatisticsCounts; ++k) counts.data_ptr<int64_t>()[k] = total.counts[k];
  at::Tensor sums = at::empty({2}, at::TensorOptions().dtype(at::kDouble));
  sums.data_ptr<double>()[0] = total.squared_error;
  sums.data_ptr<double>()[1] = total.squared_value;
  return {counts, sums};
}

// ---- CPU

Counts statistics_cpu(const at::Tensor& x, const at::Tensor& rounded, double low, double high,
                      double smallest_normal) {
  check_rounded(x, rounded);
  const Dtype dtype = container_of(x);
  const StatisticsBounds bounds = statistics_bounds(low, high, smallest_normal);
  const at::Tensor xs = x.contiguous(), ys = rounded.contiguous();
  const int64_t n = xs.numel(), chunks = chunk_count(n);
  std::vector<ChunkStatistics> parts(static_cast<size_t>(chunks));
  lpsim::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    cpu::rounding_statistics(dtype, xs.const_data_ptr(), ys.const_data_ptr(), begin, end, n, bounds,
                             parts.data());
  });
  return as_tensors(combine_chunks(parts.data(), chunks));
}

RoundedCounts quantize_grid_statistics_cpu(const at::Tensor& x,
                                           LPSIM_GRID_PARAMS() int64_t rounding, int64_t rbits,
                                           const Seed& seed, int64_t offset, double low,
                                           double high, double smallest_normal) {
  const Dtype dtype = container_of(x);
  const GridSpec spec = grid_spec(dtype, GridSpec{LPSIM_GRID_VALUES()});
  const Rounding rule = rounding_of(rounding);
  const RandomSpec random = random_spec(rule, rbits, seed, offset);
  const StatisticsBounds bounds = statistics_bounds(low, high, smallest_normal);
  const at::Tensor xs = x.contiguous();
  at::Tensor y = at::empty_like(xs);
  const int64_t n = xs.numel(), chunks = chunk_count(n);
  std::vector<ChunkStatistics> parts(static_cast<size_t>(chunks));
  lpsim::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    cpu::quantize_grid_statistics(dtype, rule, xs.const_data_ptr(), y.data_ptr(), begin, end, n,
                                  spec, random, bounds, parts.data());
  });
  const auto [counts, sums] = as_tensors(combine_chunks(parts.data(), chunks));
  return {y, counts, sums};
}

// The statistics of the contiguous xs rounded to ys, element i counted within
// bounds[block_of(layout, i)]: the blocks' chunks in parallel, combined in chunk order.
Counts statistics_by_block_cpu(Dtype dtype, const at::Tensor& xs, const at::Tensor& ys,
                               const ScaledLayout& layout,
                               const std::vector<StatisticsBounds>& bounds) {
  const int64_t n = xs.numel(), chunks = chunk_count(n);
  std::vector<ChunkStatistics> parts(static_cast<size_t>(chunks));
  lpsim::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    cpu::rounding_statistics_by_block(dtype, xs.const_data_ptr(), ys.const_data_ptr(), begin, end,
                                      n, layout, bounds.data(), parts.data());
  });
  return as_tensors(combine_chunks(parts.data(), chunks));
}

Counts scaled_statistics_cpu(const at::Tensor& x, const at::Tensor& rounded,
                             LPSIM_SCALED_FORMAT_PARAMS double element_smallest_normal) {
  check_rounded(x, rounded);
  ScaledSpec spec = LPSIM_SCALED_FORMAT_SPEC;
  const ScaledLayout layout = scaled_layout(x, block, axis);
  check_element_smallest_normal(element_smallest_normal);
  const Dtype dtype = container_of(x);
  const at::Tensor xs = x.contiguous(), ys = rounded.contiguous();
  const int64_t n = xs.numel();
  if (n == 0) return as_tensors(ChunkStatistics{});
  const IeeeSubnormals mode;  // the scales and the bounds, computed on this thread
  if (spec.two_level) set_tensor_scale_cpu(dtype, xs.const_data_ptr(), n, spec);
  const std::vector<BlockScale> scales = block_scales_cpu(dtype, xs.const_data_ptr(), layout, spec);
  std::vector<StatisticsBounds> bounds(scales.size());
  cpu::block_statistics_bounds(dtype, spec, scales.data(), static_cast<int64_t>(scales.size()),
                               element_smallest_normal, bounds.data());
  return statistics_by_block_cpu(dtype, xs, ys, layout, bounds);
}

Counts block_statistics_cpu(const at::Tensor& x, const at::Tensor& rounded, int64_t wl,
                            std::optional<int64_t> dim, std::optional<int64_t> block_size) {
  check_rounded(x, rounded);
  const BlockLayout layout = block_layout(x, wl, dim, block_size);
  const Dtype dtype = container_of(x);
  const at::Tensor xs = x.contiguous(), ys = rounded.contiguous();
  const int64_t n = xs.numel();
  if (n == 0) return as_tensors(ChunkStatistics{});
  const std::vector<uint64_t> block_max = block_max_abs_cpu(dtype, xs.const_data_ptr(), n, layout);
  std::vector<StatisticsBounds> bounds(block_max.size());
  cpu::block_float_statistics_bounds(dtype, block_max.data(), static_cast<int64_t>(bounds.size()),
                                     static_cast<int32_t>(wl), bounds.data());
  return statistics_by_block_cpu(dtype, xs, ys, block_tiles(layout, n), bounds);
}

// ---- CUDA: the kernels run on x's device, on its current stream; the chunks' statistics are
// copied to the host and combined there.

#if defined(LPSIM_WITH_CUDA)
// The statistics of the n > 0 elements of x's device tensor, whose chunks' statistics
// launch(container, chunks) enqueues on `stream` into device memory; combined on the host.
template <class Launch>
Counts chunk_statistics_cuda(const at::Tensor& x, int64_t n, cudaStream_t stream, Launch launch) {
  const int64_t chunks = chunk_count(n);
  at::Tensor parts =
      at::empty({chunks * int64_t{sizeof(ChunkStatistics)}}, x.options().dtype(at::kByte));
  with_container(container_of(x), [&](auto container) {
    launch(container, static_cast<ChunkStatistics*>(parts.data_ptr()));
  });
  const at::Tensor host = parts.cpu();
  return as_tensors(
      combine_chunks(static_cast<const ChunkStatistics*>(host.const_data_ptr()), chunks));
}

Counts statistics_of_contiguous_cuda(const at::Tensor& xs, const at::Tensor& ys,
                                     const StatisticsBounds& bounds) {
  const int64_t n = xs.numel();
  if (n == 0) return as_tensors(ChunkStatistics{});
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(xs.device().index()).stream();
  return chunk_statistics_cuda(xs, n, stream, [&](auto container, ChunkStatistics* parts) {
    using C = decltype(container);
    gpu::rounding_statistics<C>(xs.const_data_ptr(), ys.const_data_ptr(), n, bounds, parts, stream);
  });
}

Counts statistics_cuda(const at::Tensor& x, const at::Tensor& rounded, double low, double high,
                       double smallest_normal) {
  check_rounded(x, rounded);
  container_of(x);  // TypeError for other dtypes
  const StatisticsBounds bounds = statistics_bounds(low, high, smallest_normal);
  const c10::cuda::CUDAGuard guard(x.device());
  return statistics_of_contiguous_cuda(x.contiguous(), rounded.contiguous(), bounds);
}

// One kernel rounds and counts (gpu::quantize_grid_statistics): x is read once.
RoundedCounts quantize_grid_statistics_cuda(const at::Tensor& x,
                                            LPSIM_GRID_PARAMS() int64_t rounding, int64_t rbits,
                                            const Seed& seed, int64_t offset, double low,
                                            double high, double smallest_normal) {
  const Dtype dtype = container_of(x);
  const GridSpec spec = grid_spec(dtype, GridSpec{LPSIM_GRID_VALUES()});
  const Rounding rule = rounding_of(rounding);
  const RandomSpec random = random_spec(rule, rbits, seed, offset);
  const StatisticsBounds bounds = statistics_bounds(low, high, smallest_normal);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xs = x.contiguous();
  at::Tensor y = at::empty_like(xs);
  const int64_t n = xs.numel();
  if (n == 0) {
    const auto [counts, sums] = as_tensors(ChunkStatistics{});
    return {y, counts, sums};
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  const auto [counts, sums] =
      chunk_statistics_cuda(xs, n, stream, [&](auto container, ChunkStatistics* parts) {
        using C = decltype(container);
        gpu::quantize_grid_statistics<C>(rule, xs.const_data_ptr(), y.data_ptr(), n, spec, random,
                                         bounds, parts, stream);
      });
  return {y, counts, sums};
}

// The blocks' scales and bounds (gpu::scaled_block_bounds), then the statistics of each element
// within its block's (gpu::scaled_rounding_statistics).
Counts scaled_statistics_cuda(const at::Tensor& x, const at::Tensor& rounded,
                              LPSIM_SCALED_FORMAT_PARAMS double element_smallest_normal) {
  check_rounded(x, rounded);
  const ScaledSpec spec = LPSIM_SCALED_FORMAT_SPEC;
  const ScaledLayout layout = scaled_layout(x, block, axis);
  check_element_smallest_normal(element_smallest_normal);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xs = x.contiguous(), ys = rounded.contiguous();
  const int64_t n = xs.numel();
  if (n == 0) return as_tensors(ChunkStatistics{});
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  // Scratch: each block's largest magnitude bits and, last, the tensor's; the blocks' scales; their
  // bounds.
  const int64_t blocks = layout.blocks();
  const at::Tensor amax = at::zeros({blocks + 1}, xs.options().dtype(at::kLong));
  const at::Tensor scales =
      at::empty({blocks * static_cast<int64_t>(sizeof(BlockScale))}, xs.options().dtype(at::kByte));
  const at::Tensor bounds = at::empty({blocks * static_cast<int64_t>(sizeof(StatisticsBounds))},
                                      xs.options().dtype(at::kByte));
  return chunk_statistics_cuda(xs, n, stream, [&](auto container, ChunkStatistics* parts) {
    using C = decltype(container);
    auto* block_bounds = static_cast<StatisticsBounds*>(bounds.data_ptr());
    gpu::scaled_block_bounds<C>(xs.const_data_ptr(), n, layout, spec, amax.data_ptr(),
                                scales.data_ptr(), element_smallest_normal, block_bounds, stream);
    gpu::rounding_statistics_by_block<C>(xs.const_data_ptr(), ys.const_data_ptr(), n, layout,
                                         block_bounds, parts, stream);
  });
}

// The blocks' largest magnitudes (gpu::block_max_abs, as the quantize_block ops find them) and
// bounds, then the statistics of each element within its block's.
Counts block_statistics_cuda(const at::Tensor& x, const at::Tensor& rounded, int64_t wl,
                             std::optional<int64_t> dim, std::optional<int64_t> block_size) {
  check_rounded(x, rounded);
  const BlockLayout layout = block_layout(x, wl, dim, block_size);
  const Dtype dtype = container_of(x);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xs = x.contiguous(), ys = rounded.contiguous();
  const int64_t n = xs.numel();
  if (n == 0) return as_tensors(ChunkStatistics{});
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  // Scratch: each block's largest finite magnitude in the container's word type; their bounds.
  const int64_t blocks = layout.blocks(n);
  const at::Tensor block_max =
      at::zeros({blocks}, xs.options().dtype(dtype == Dtype::float64 ? at::kLong : at::kInt));
  const at::Tensor bounds = at::empty({blocks * static_cast<int64_t>(sizeof(StatisticsBounds))},
                                      xs.options().dtype(at::kByte));
  const ScaledLayout tiles = block_tiles(layout, n);
  return chunk_statistics_cuda(xs, n, stream, [&](auto container, ChunkStatistics* parts) {
    using C = decltype(container);
    auto* block_bounds = static_cast<StatisticsBounds*>(bounds.data_ptr());
    gpu::block_max_abs<C>(xs.const_data_ptr(), n, layout, block_max.data_ptr(), stream);
    gpu::block_float_statistics_bounds<C>(block_max.const_data_ptr(), blocks,
                                          static_cast<int32_t>(wl), block_bounds, stream);
    gpu::rounding_statistics_by_block<C>(xs.const_data_ptr(), ys.const_data_ptr(), n, tiles,
                                         block_bounds, parts, stream);
  });
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(lpsim, m) {
  const std::string bounds = "float low, float high, float smallest_normal";
  m.def(("rounding_statistics(Tensor x, Tensor rounded, " + bounds + ") -> (Tensor, Tensor)")
            .c_str());
  m.def(("quantize_grid_statistics(Tensor x, " + grid_schema() + ", " + kRandomSchema + ", " +
         bounds + ") -> (Tensor, Tensor, Tensor)")
            .c_str());
  m.def(("scaled_rounding_statistics(Tensor x, Tensor rounded, " + scaled_format_schema() +
         ", float element_smallest_normal) -> (Tensor, Tensor)")
            .c_str());
  m.def(
      "block_rounding_statistics(Tensor x, Tensor rounded, int wl, int? dim, int? block_size) -> "
      "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(lpsim, CPU, m) {
  m.impl("rounding_statistics", statistics_cpu);
  m.impl("quantize_grid_statistics", quantize_grid_statistics_cpu);
  m.impl("scaled_rounding_statistics", scaled_statistics_cpu);
  m.impl("block_rounding_statistics", block_statistics_cpu);
}

#if defined(LPSIM_WITH_CUDA)
TORCH_LIBRARY_IMPL(lpsim, CUDA, m) {
  m.impl("rounding_statistics", statistics_cuda);
  m.impl("quantize_grid_statistics", quantize_grid_statistics_cuda);
  m.impl("scaled_rounding_statistics", scaled_statistics_cuda);
  m.impl("block_rounding_statistics", block_statistics_cuda);
}
#endif

}  // namespace lpsim
