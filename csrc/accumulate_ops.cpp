// The accumulation ops: schemas (a fragment of the lpsim library), argument checks, and the torch
// glue around the CPU loops (cpu/accumulate.h).
//
//   sum_rounded   recursive sums (and cumulative sums) rounded after every addition
//   dot_rounded   dot products: exact products, optionally rounded, summed as above
//   mac_matmul    matrix products under a MAC (lpsim/mac.h): products, accumulator, order, Kahan,
//                 tensor core (lpsim/tensor_core.h; group 0: none)
//   to_container  their results converted to the output dtype
//
// The first three return float64 tensors whose values lie in the accumulation format;
// lpsim/accumulate.py and lpsim/mac.py validate formats and shapes and convert the results to the
// output dtype with to_container, which holds them exactly.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>
#include <type_traits>

#include "checks.h"
#include "cpu/accumulate.h"
#include "cpu/loops.h"
#include "dispatch.h"
#include "parallel.h"

#if defined(LPSIM_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/mac.h"
#endif

namespace lpsim {
namespace {

// Reductions per parallel task: enough terms to amortise a task's start.
int64_t reduction_grain(int64_t terms) {
  return std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(terms, 1));
}

at::Tensor sum_rounded_cpu(const at::Tensor& x, int64_t outer, int64_t n, int64_t inner,
                           bool cumulative, LPSIM_GRID_PARAMS() int64_t rounding, int64_t rbits,
                           const Seed& seed, int64_t offset) {
  const Dtype dtype = container_of(x);
  TORCH_CHECK(outer >= 0 && n >= 0 && inner >= 1 && outer * n * inner == x.numel(),
              "lpsim: sum_rounded needs outer * n * inner = x.numel(), got ", outer, " * ", n,
              " * ", inner, " for ", x.numel(), " elements");
  // Sums are computed in float64 (every format fits it).
  const GridSpec acc = sum_grid_spec(Dtype::float64, GridSpec{LPSIM_GRID_VALUES()});
  const Rounding rule = rounding_of(rounding);
  const RandomSpec random = random_spec(rule, rbits, seed, offset);
  const at::Tensor src = x.contiguous();
  const int64_t reductions = outer * inner;
  at::Tensor y =
      at::empty({cumulative ? outer * n * inner : reductions}, x.options().dtype(at::kDouble));
  const void* xp = src.const_data_ptr();
  auto* yp = reinterpret_cast<uint64_t*>(y.data_ptr<double>());
  lpsim::parallel_for(0, reductions, reduction_grain(n), [&](int64_t begin, int64_t end) {
    cpu::sum_rounded(dtype, rule, xp, yp, n, inner, begin, end, cumulative, acc, random);
  });
  return y;
}

// The operands' container, checked: a (m, n) and b (p, n) of one dtype whose products float64
// holds exactly (not float64).
Dtype check_product_operands(const at::Tensor& a, const at::Tensor& b, const char* op) {
  const Dtype dtype = container_of(a);
  TORCH_CHECK_TYPE(dtype != Dtype::float64,
                   "lpsim: products are formed exactly in float64, so the operands must be "
                   "float32, bfloat16 or float16 tensors, got float64");
  TORCH_CHECK_TYPE(b.scalar_type() == a.scalar_type(),
                   "lpsim: both operands must have one dtype, got ", a.scalar_type(), " and ",
                   b.scalar_type());
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1), "lpsim: ", op,
              " takes a (m, n) and b (p, n), got ", a.sizes(), " and ", b.sizes());
  return dtype;
}

// The float64 (m, p) results of a (m, n) times the rows of b (p, n): loop(a, b, y, n, p, begin,
// end) computes the results [begin, end) in row-major order, split across threads.
template <class Loop>
at::Tensor product_results(const at::Tensor& a, const at::Tensor& b, const Loop& loop) {
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  const int64_t m = a.size(0), n = a.size(1), p = b.size(0);
  at::Tensor y = at::empty({m, p}, a.options().dtype(at::kDouble));
  const void* ap = ac.const_data_ptr();
  const void* bp = bc.const_data_ptr();
  auto* yp = reinterpret_cast<uint64_t*>(y.data_ptr<double>());
  lpsim::parallel_for(0, m * p, reduction_grain(n),
                      [&](int64_t begin, int64_t end) { loop(ap, bp, yp, n, p, begin, end); });
  return y;
}

at::Tensor dot_rounded_cpu(const at::Tensor& a, const at::Tensor& b, bool has_mul,
                           LPSIM_GRID_PARAMS(mul_) LPSIM_GRID_PARAMS() int64_t rounding,
                           int64_t rbits, const Seed& seed, int64_t offset) {
  const Dtype dtype = check_product_operands(a, b, "dot_rounded");
  const GridSpec acc = sum_grid_spec(Dtype::float64, GridSpec{LPSIM_GRID_VALUES()});
  GridSpec mul{};
  if (has_mul) mul = sum_grid_spec(Dtype::float64, GridSpec{LPSIM_GRID_VALUES(mul_)});
  const Rounding rule = rounding_of(rounding);
  const RandomSpec random = random_spec(rule, rbits, seed, offset);
  const GridSpec* mul_grid = has_mul ? &mul : nullptr;
  return product_results(a, b,
                         [&](const void* ap, const void* bp, uint64_t* yp, int64_t n, int64_t p,
                             int64_t begin, int64_t end) {
                           cpu::dot_rounded(dtype, rule, ap, bp, yp, n, p, begin, end, mul_grid,
                                            acc, random);
                         });
}

// The tensor core's fields, checked (group 0: none).
TensorCoreSpec tensor_core_spec(int64_t order, int64_t chunk, int64_t group, int64_t fraction_bits,
                                std::optional<int64_t> exponent_floor, int64_t operand_emin,
                                int64_t normalise) {
  TORCH_CHECK(group >= 0 && group <= kMaxTensorCoreGroup,
              "lpsim: mac_matmul's group must be in [0, ", kMaxTensorCoreGroup, "], got ", group);
  if (group == 0) return TensorCoreSpec{};
  TORCH_CHECK(order != static_cast<int64_t>(MacOrder::kPairwise),
              "lpsim: a tensor core chains its groups sequentially or in chunks, not pairwise");
  TORCH_CHECK(order != static_cast<int64_t>(MacOrder::kChunked) || chunk % group == 0,
              "lpsim: mac_matmul's chunk must be a multiple of the group, got ", chunk, " and ",
              group);
  TORCH_CHECK(fraction_bits >= 0 && fraction_bits <= kMaxFractionBits,
              "lpsim: mac_matmul's fraction_bits must be in [0, ", kMaxFractionBits, "], got ",
              fraction_bits);
  TORCH_CHECK(!exponent_floor.has_value() || std::abs(*exponent_floor) <= 1000,
              "lpsim: mac_matmul's exponent_floor must be in [-1000, 1000], got ",
              exponent_floor.value_or(0));
  TORCH_CHECK(operand_emin >= -1000 && operand_emin <= 1000,
              "lpsim: mac_matmul's operand_emin must be in [-1000, 1000], got ", operand_emin);
  return TensorCoreSpec{
      static_cast<int32_t>(group), static_cast<int32_t>(fraction_bits),
      exponent_floor.has_value() ? static_cast<int32_t>(*exponent_floor) : kNoExponentFloor,
      static_cast<int32_t>(operand_emin), rounding_of(normalise)};
}

// mac_matmul's arguments, checked and decoded: the shape, the grids and the random stream.
struct MacArguments {
  Dtype dtype;
  MacShape shape;
  GridSpec acc, inner, product;
  bool has_product;
  Rounding rule;
  RandomSpec random;
  const GridSpec* product_grid() const { return has_product ? &product : nullptr; }
};

// mac_matmul's parameters (the schema's, in its order), and the same names as arguments.
#define LPSIM_MAC_PARAMS                                                                          \
  const at::Tensor &a, const at::Tensor &b, int64_t order, int64_t chunk, bool compensated,       \
      bool has_product, int64_t group, int64_t fraction_bits,                                     \
      std::optional<int64_t> exponent_floor, int64_t operand_emin, int64_t normalise,             \
      LPSIM_GRID_PARAMS(product_) LPSIM_GRID_PARAMS(chunk_) LPSIM_GRID_PARAMS() int64_t rounding, \
      int64_t rbits, const Seed &seed, int64_t offset
#define LPSIM_MAC_VALUES                                                                         \
  a, b, order, chunk, compensated, has_product, group, fraction_bits, exponent_floor,            \
      operand_emin, normalise,                                                                   \
      LPSIM_GRID_VALUES(product_) LPSIM_GRID_VALUES(chunk_) LPSIM_GRID_VALUES() rounding, rbits, \
      seed, offset

MacArguments mac_arguments(LPSIM_MAC_PARAMS) {
  MacArguments args{};
  args.dtype = check_product_operands(a, b, "mac_matmul");
  TORCH_CHECK(order >= 0 && order <= static_cast<int64_t>(MacOrder::kPairwise),
              "lpsim: mac_matmul's order must be 0 (sequential), 1 (chunked) or 2 (pairwise), got ",
              order);
  TORCH_CHECK(chunk >= 1, "lpsim: mac_matmul's chunk must be at least 1, got ", chunk);
  args.shape = MacShape{static_cast<MacOrder>(order), chunk, compensated,
                        tensor_core_spec(order, chunk, group, fraction_bits, exponent_floor,
                                         operand_emin, normalise)};
  args.acc = sum_grid_spec(Dtype::float64, GridSpec{LPSIM_GRID_VALUES()});
  args.inner = sum_grid_spec(Dtype::float64, GridSpec{LPSIM_GRID_VALUES(chunk_)});
  args.has_product = has_product;
  if (has_product) {
    args.product = sum_grid_spec(Dtype::float64, GridSpec{LPSIM_GRID_VALUES(product_)});
  }
  args.rule = rounding_of(rounding);
  // The rule that draws random words, and a missing seed: a stochastic tensor-core normalisation
  // if there is one, else the rounding (lpsim.MAC.drawing_rule).
  const TensorCoreSpec& core = args.shape.tensor_core;
  const bool core_draws = core.group != 0 && is_stochastic(core.normalise);
  args.random = random_spec(core_draws ? core.normalise : args.rule, rbits, seed, offset);
  return args;
}

at::Tensor mac_matmul_cpu(LPSIM_MAC_PARAMS) {
  const MacArguments args = mac_arguments(LPSIM_MAC_VALUES);
  return product_results(a, b,
                         [&](const void* ap, const void* bp, uint64_t* yp, int64_t n, int64_t p,
                             int64_t begin, int64_t end) {
                           cpu::mac_matmul(args.dtype, args.rule, ap, bp, yp, n, p, begin, end,
                                           args.shape, args.product_grid(), args.acc, args.inner,
                                           args.random);
                         });
}

#if defined(LPSIM_WITH_CUDA)
// The kernel runs on a's device, on its current stream.
at::Tensor mac_matmul_cuda(LPSIM_MAC_PARAMS) {
  const MacArguments args = mac_arguments(LPSIM_MAC_VALUES);
  TORCH_CHECK(b.device() == a.device(), "lpsim: mac_matmul's operands must be on one device, got ",
              a.device(), " and ", b.device());
  const c10::cuda::CUDAGuard guard(a.device());
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  const int64_t m = a.size(0), n = a.size(1), p = b.size(0);
  at::Tensor y = at::empty({m, p}, a.options().dtype(at::kDouble));
  if (m == 0 || p == 0) return y;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.device().index()).stream();
  with_container(args.dtype, [&](auto container) {
    using X = decltype(container);
    if constexpr (!std::is_same_v<X, Float64Container>) {  // refused by check_product_operands
      gpu::mac_matmul<X>(args.rule, ac.const_data_ptr(), bc.const_data_ptr(),
                         reinterpret_cast<uint64_t*>(y.data_ptr<double>()), m, n, p, args.shape,
                         args.product_grid(), args.acc, args.inner, args.random, stream);
    }
  });
  return y;
}
#endif

// x converted to dtype by torch's conversion, on the CPU with IEEE subnormals (parallel.h): the
// float64 results above lie on grids that dtype holds, so they are kept exactly, subnormals too,
// whatever the caller's flush-to-zero mode.
at::Tensor to_container_cpu(const at::Tensor& x, at::ScalarType dtype) {
  TORCH_CHECK(x.scalar_type() == at::kDouble, "lpsim: to_container takes float64, got ",
              x.scalar_type());
  const at::Tensor src = x.contiguous();
  at::Tensor y = at::empty_like(src, src.options().dtype(dtype));
  const at::Tensor from = src.view(-1), to = y.view(-1);
  lpsim::parallel_for(0, src.numel(), cpu::kGrain, [&](int64_t begin, int64_t end) {
    to.slice(0, begin, end).copy_(from.slice(0, begin, end));
  });
  return y;
}

#if defined(LPSIM_WITH_CUDA)
at::Tensor to_container_cuda(const at::Tensor& x, at::ScalarType dtype) {
  TORCH_CHECK(x.scalar_type() == at::kDouble, "lpsim: to_container takes float64, got ",
              x.scalar_type());
  return x.to(dtype, /*non_blocking=*/false, /*copy=*/true, at::MemoryFormat::Contiguous);
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(lpsim, m) {
  const auto def = [&m](const std::string& schema) { m.def(schema.c_str()); };
  def("sum_rounded(Tensor x, int outer, int n, int inner, bool cumulative, " + grid_schema() +
      ", " + kRandomSchema + ") -> Tensor");
  def("dot_rounded(Tensor a, Tensor b, bool has_mul, " + grid_schema("mul_") + ", " +
      grid_schema() + ", " + kRandomSchema + ") -> Tensor");
  def("mac_matmul(Tensor a, Tensor b, int order, int chunk, bool compensated, bool has_product, "
      "int group, int fraction_bits, int? exponent_floor, int operand_emin, int normalise, " +
      grid_schema("product_") + ", " + grid_schema("chunk_") + ", " + grid_schema() + ", " +
      kRandomSchema + ") -> Tensor");
  def("to_container(Tensor x, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(lpsim, CPU, m) {
  m.impl("sum_rounded", sum_rounded_cpu);
  m.impl("dot_rounded", dot_rounded_cpu);
  m.impl("mac_matmul", mac_matmul_cpu);
  m.impl("to_container", to_container_cpu);
}

#if defined(LPSIM_WITH_CUDA)
TORCH_LIBRARY_IMPL(lpsim, CUDA, m) {
  m.impl("mac_matmul", mac_matmul_cuda);
  m.impl("to_container", to_container_cuda);
}
#endif

}  // namespace lpsim
