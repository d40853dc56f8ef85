// The multi-tensor quantize op (a fragment of the lpsim library):
//
//   quantize_grid_many_   every tensor of a list rounded in place onto one Float or Fixed grid
//
// Tensor number i draws its random words from the stream offset + i under the seed, so it is
// rounded exactly as quantize_grid_(xs[i], ..., offset + i) rounds it. The tensors may have
// different dtypes (each is its own container), shapes and strides; they must not overlap. On the
// CPU all their elements are one parallel region (multi_tensor.h) over the single-tensor op's loop
// (cpu::quantize_grid); on CUDA one kernel launch rounds a chunk of tensors of one dtype
// (gpu::quantize_grid_many). lpsim/multi_tensor.py validates the arguments; the checks here guard
// against direct calls.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "checks.h"
#include "cpu/quantize.h"
#include "multi_tensor.h"

#if defined(LPSIM_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/quantize.h"
#include "dispatch.h"
#endif

namespace lpsim {
namespace {

// The tensors' elements, as byte ranges from their first to past their last, must not meet: the
// tensors are rounded concurrently (non-contiguous ones through copies written back), so an element
// of two of them would be rounded twice, by two streams, or raced. Ranges that meet are refused
// even where two views' strides interleave without sharing an element (x[::2] and x[1::2]), which
// separate calls round.
void check_disjoint(at::TensorList xs) {
  struct Range {
    uintptr_t begin, end;
    size_t index;
  };
  std::vector<Range> ranges;
  for (size_t i = 0; i < xs.size(); ++i) {
    const at::Tensor& x = xs[i];
    if (x.numel() == 0) continue;
    int64_t last = 0;  // the last element's offset from the first, in elements (strides >= 0)
    for (int64_t d = 0; d < x.dim(); ++d) last += (x.size(d) - 1) * x.stride(d);
    const auto begin = reinterpret_cast<uintptr_t>(x.data_ptr());
    ranges.push_back({begin, begin + static_cast<uintptr_t>((last + 1) * x.element_size()), i});
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin; });
  const Range* furthest = ranges.empty() ? nullptr : &ranges[0];  // reaching furthest so far
  for (size_t k = 1; k < ranges.size(); ++k) {
    TORCH_CHECK_VALUE(ranges[k].begin >= furthest->end, "lpsim: tensors[",
                      std::min(furthest->index, ranges[k].index), "] and tensors[",
                      std::max(furthest->index, ranges[k].index),
                      "] overlap in memory: every tensor is rounded once, concurrently, so they "
                      "must not share elements (round views of one tensor in separate calls)");
    if (ranges[k].end > furthest->end) furthest = &ranges[k];
  }
}

// The tensors of one call, checked: each one's container (the grid must fit it) and a contiguous
// buffer to round in place (the tensor itself, or a copy that finish() writes back).
struct ManyTensors {
  std::vector<Destination> buffers;
  std::vector<Dtype> dtypes;
  std::vector<int64_t> numels;

  ManyTensors(at::TensorList xs, const GridSpec& spec) {
    check_disjoint(xs);
    for (size_t i = 0; i < xs.size(); ++i) {
      const at::Tensor& x = xs[i];
      TORCH_CHECK(x.device() == xs[0].device(), "lpsim: tensors[", i, "] is on ", x.device(),
                  ", tensors[0] on ", xs[0].device(), ": all must be on one device");
      dtypes.push_back(container_of(x));
      grid_spec(dtypes.back(), spec);
      buffers.emplace_back(x, /*keep_values=*/true);
      numels.push_back(x.numel());
    }
  }

  void finish() {
    for (Destination& d : buffers) d.finish();
  }
};

#define LPSIM_MANY_ARGS \
  LPSIM_GRID_PARAMS() int64_t rounding, int64_t rbits, const Seed &seed, int64_t offset

void quantize_grid_many_cpu(at::TensorList xs, LPSIM_MANY_ARGS) {
  const GridSpec spec{LPSIM_GRID_VALUES()};
  const Rounding rule = rounding_of(rounding);
  const RandomSpec random = random_spec(rule, rbits, seed, offset);
  ManyTensors many(xs, spec);
  std::vector<void*> data;
  for (Destination& d : many.buffers) data.push_back(d.buffer.data_ptr());
  for_each_span(many.numels, [&](const Span& s) {
    RandomSpec stream = random;
    stream.offset += s.tensor;  // modulo 2^64, as the offsets are 64-bit words
    cpu::quantize_grid(many.dtypes[s.tensor], rule, data[s.tensor], data[s.tensor], s.begin, s.end,
                       spec, stream);
  });
  many.finish();
}

#if defined(LPSIM_WITH_CUDA)
void quantize_grid_many_cuda(at::TensorList xs, LPSIM_MANY_ARGS) {
  const GridSpec spec{LPSIM_GRID_VALUES()};
  const Rounding rule = rounding_of(rounding);
  const RandomSpec random = random_spec(rule, rbits, seed, offset);
  if (xs.empty()) return;
  ManyTensors many(xs, spec);
  const c10::cuda::CUDAGuard guard(xs[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(xs[0].device().index()).stream();
  // One list per container: a launch rounds tensors of one dtype.
  for (const Dtype dtype : {Dtype::float32, Dtype::float64, Dtype::bfloat16, Dtype::float16}) {
    std::vector<gpu::ManyTensor> list;
    for (size_t i = 0; i < xs.size(); ++i) {
      if (many.dtypes[i] == dtype && many.numels[i] > 0) {
        list.push_back({many.buffers[i].buffer.data_ptr(), many.numels[i], random.offset + i});
      }
    }
    if (list.empty()) continue;
    with_container(dtype, [&](auto container) {
      using C = decltype(container);
      gpu::quantize_grid_many<C>(rule, list.data(), static_cast<int64_t>(list.size()), spec, random,
                                 stream);
    });
  }
  many.finish();
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(lpsim, m) {
  m.def(("quantize_grid_many_(Tensor(a!)[] xs, " + grid_schema() + ", " + kRandomSchema + ") -> ()")
            .c_str());
  // The same check for quantize_many_'s loop of quantize_ (BlockFloat and Scaled formats).
  m.def("_check_disjoint(Tensor[] xs) -> ()", [](at::TensorList xs) { check_disjoint(xs); });
}

TORCH_LIBRARY_IMPL(lpsim, CPU, m) { m.impl("quantize_grid_many_", quantize_grid_many_cpu); }

#if defined(LPSIM_WITH_CUDA)
TORCH_LIBRARY_IMPL(lpsim, CUDA, m) { m.impl("quantize_grid_many_", quantize_grid_many_cuda); }
#endif

}  // namespace lpsim
