// The stochastic-arithmetic ops: schemas (a TORCH_LIBRARY_FRAGMENT of the lpsim library) and
// their CPU implementations.
//
//   sr_add, sr_add_        a + b computed exactly, rounded once onto a Float or Fixed grid
//   sr_addc, sr_addc_      a + value * (t1 * t2) or a + value * (t1 / t2), the term computed in
//                          float32 (float64 if an operand is float64), the sum exact, rounded once
//   sum_rounded            recursive sums (and cumulative sums) rounded after every addition
//   dot_rounded            dot products: exact products, optionally rounded, summed as above
//   value_words            test hook: the value-keyed random words
//
// The update ops take a's dtype as the container and draw position- or value-keyed words
// (randomness 0 or 1). The accumulation ops return float64 tensors whose values lie in the
// accumulation format; lpsim/ops.py converts them to the output dtype. lpsim/arithmetic.py and
// lpsim/ops.py validate formats and shapes; the checks here guard against direct calls.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/copy.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <string>

#include <lpsim/philox.h>

#include "arith_ops.h"
#include "ops.h"

namespace lpsim {

cpu::Randomness randomness_of(int64_t code) {
  TORCH_CHECK(code == 0 || code == 1,
              "lpsim: randomness code must be 0 (position) or 1 (value), got ", code);
  return static_cast<cpu::Randomness>(code);
}

cpu::Dtype operand_of(const at::Tensor& a, const at::Tensor& b, const char* name) {
  container_of(a);
  const at::ScalarType t = b.scalar_type();
  TORCH_CHECK_TYPE(t == a.scalar_type() || t == at::kFloat || t == at::kDouble, "lpsim: ", name,
                   " must have the dtype of a (", a.scalar_type(), "), float32 or float64, got ",
                   t);
  TORCH_CHECK(b.sizes() == a.sizes(), "lpsim: ", name, " must have the shape of a, ", a.sizes(),
              ", got ", b.sizes());
  TORCH_CHECK(b.device() == a.device(), "lpsim: ", name, " must be on the device of a");
  return container_of(b);
}

GridSpec sum_grid_spec(cpu::Dtype dtype, int64_t keep, int64_t qmin, int64_t emin,
                       bool subnormals, double pos_limit, double neg_limit, bool saturate,
                       bool has_inf, bool unsigned_zero) {
  // A sum may be rounded in a wider container than the result's, so the grid must not depend on
  // the container: lpsim.arithmetic.sum_grid gives the precision and the limits explicitly.
  TORCH_CHECK(keep >= 0 && std::isfinite(pos_limit) && std::isfinite(neg_limit),
              "lpsim: the sum ops take grids with an explicit precision and finite limits "
              "(lpsim.arithmetic.sum_grid makes them), got keep=", keep, ", limits ", pos_limit,
              " and ", neg_limit);
  return grid_spec(dtype, keep, qmin, emin, subnormals, pos_limit, neg_limit, saturate, has_inf,
                   unsigned_zero);
}

Update make_update(const at::Tensor& a, const at::Tensor& operand, const char* name, int64_t keep,
                   int64_t qmin, int64_t emin, bool subnormals, double pos_limit,
                   double neg_limit, bool saturate, bool has_inf, bool unsigned_zero,
                   int64_t rounding, int64_t rbits, const at::Tensor& seed, int64_t offset,
                   int64_t randomness) {
  Update u{};
  u.a = container_of(a);
  u.operand = operand_of(a, operand, name);
  u.grid = sum_grid_spec(u.a, keep, qmin, emin, subnormals, pos_limit, neg_limit, saturate,
                         has_inf, unsigned_zero);
  u.rounding = rounding_of(rounding);
  u.random = random_spec(rbits, seed, offset);
  u.randomness = randomness_of(randomness);
  return u;
}

namespace {

// Elements per parallel task; a multiple of the random-word group so tasks do not share a group.
constexpr int64_t kGrain = 64 * kGroupSize;

// The CPU kernels of the update ops: the elements split across threads in whole groups of random
// words (any split gives the same result, since every word depends on its index only).
void add_kernel_cpu(const at::Tensor&, const Update& u) {
  at::parallel_for(0, u.n, kGrain, [&](int64_t begin, int64_t end) {
    cpu::add_rounded(u.a, u.operand, u.rounding, u.randomness, u.x, u.b, u.y, begin, end, u.grid,
                     u.random);
  });
}

void addc_kernel_cpu(const at::Tensor&, const Update& u) {
  at::parallel_for(0, u.n, kGrain, [&](int64_t begin, int64_t end) {
    cpu::addc_rounded(u.a, u.operand, u.divide, u.value, u.rounding, u.randomness, u.x, u.t1, u.t2,
                      u.y, begin, end, u.grid, u.random);
  });
}

// A grid for the float64 container the accumulation ops compute in.
GridSpec accumulation_grid(int64_t keep, int64_t qmin, int64_t emin, bool subnormals,
                           double pos_limit, double neg_limit, bool saturate, bool has_inf,
                           bool unsigned_zero) {
  return sum_grid_spec(cpu::Dtype::float64, keep, qmin, emin, subnormals, pos_limit, neg_limit,
                   saturate, has_inf, unsigned_zero);
}

// Reductions per parallel task: enough terms to amortise a task's start.
int64_t reduction_grain(int64_t terms) { return std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(terms, 1)); }

at::Tensor sum_rounded_cpu(const at::Tensor& x, int64_t outer, int64_t n, int64_t inner,
                           bool cumulative, int64_t keep, int64_t qmin, int64_t emin,
                           bool subnormals, double pos_limit, double neg_limit, bool saturate,
                           bool has_inf, bool unsigned_zero, int64_t rounding, int64_t rbits,
                           const at::Tensor& seed, int64_t offset) {
  const cpu::Dtype dtype = container_of(x);
  TORCH_CHECK(outer >= 0 && n >= 0 && inner >= 1 && outer * n * inner == x.numel(),
              "lpsim: sum_rounded needs outer * n * inner = x.numel(), got ", outer, " * ", n,
              " * ", inner, " for ", x.numel(), " elements");
  const GridSpec acc = accumulation_grid(keep, qmin, emin, subnormals, pos_limit, neg_limit,
                                         saturate, has_inf, unsigned_zero);
  const Rounding rule = rounding_of(rounding);
  const RandomSpec random = random_spec(rbits, seed, offset);
  const at::Tensor src = x.contiguous();
  const int64_t reductions = outer * inner;
  at::Tensor y = at::empty({cumulative ? outer * n * inner : reductions},
                           x.options().dtype(at::kDouble));
  const void* xp = src.const_data_ptr();
  auto* yp = reinterpret_cast<uint64_t*>(y.data_ptr<double>());
  at::parallel_for(0, reductions, reduction_grain(n), [&](int64_t begin, int64_t end) {
    cpu::sum_rounded(dtype, rule, xp, yp, n, inner, begin, end, cumulative, acc, random);
  });
  return y;
}

at::Tensor dot_rounded_cpu(const at::Tensor& a, const at::Tensor& b, bool has_mul,
                           int64_t mul_keep, int64_t mul_qmin, int64_t mul_emin,
                           bool mul_subnormals, double mul_pos_limit, double mul_neg_limit,
                           bool mul_saturate, bool mul_has_inf, bool mul_unsigned_zero,
                           int64_t keep, int64_t qmin, int64_t emin, bool subnormals,
                           double pos_limit, double neg_limit, bool saturate, bool has_inf,
                           bool unsigned_zero, int64_t rounding, int64_t rbits,
                           const at::Tensor& seed, int64_t offset) {
  const cpu::Dtype dtype = container_of(a);
  TORCH_CHECK_TYPE(dtype != cpu::Dtype::float64,
                   "lpsim: products are formed exactly in float64, so the operands must be "
                   "float32, bfloat16 or float16 tensors, got float64");
  TORCH_CHECK_TYPE(b.scalar_type() == a.scalar_type(), "lpsim: both operands must have one dtype, got ",
                   a.scalar_type(), " and ", b.scalar_type());
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(1),
              "lpsim: dot_rounded takes a (m, n) and b (p, n), got ", a.sizes(), " and ", b.sizes());
  const GridSpec acc = accumulation_grid(keep, qmin, emin, subnormals, pos_limit, neg_limit,
                                         saturate, has_inf, unsigned_zero);
  GridSpec mul{};
  if (has_mul) {
    mul = accumulation_grid(mul_keep, mul_qmin, mul_emin, mul_subnormals, mul_pos_limit,
                            mul_neg_limit, mul_saturate, mul_has_inf, mul_unsigned_zero);
  }
  const Rounding rule = rounding_of(rounding);
  const RandomSpec random = random_spec(rbits, seed, offset);
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  const int64_t m = a.size(0), n = a.size(1), p = b.size(0);
  at::Tensor y = at::empty({m, p}, a.options().dtype(at::kDouble));
  const void* ap = ac.const_data_ptr();
  const void* bp = bc.const_data_ptr();
  auto* yp = reinterpret_cast<uint64_t*>(y.data_ptr<double>());
  const GridSpec* mul_grid = has_mul ? &mul : nullptr;
  at::parallel_for(0, m * p, reduction_grain(n), [&](int64_t begin, int64_t end) {
    cpu::dot_rounded(dtype, rule, ap, bp, yp, n, p, begin, end, mul_grid, acc, random);
  });
  return y;
}

// Test hook: value_word for operands given as the int64 views of float64 bits, under (seed, offset).
at::Tensor value_words_cpu(const at::Tensor& a_bits, const at::Tensor& b_bits,
                           const at::Tensor& seed, int64_t offset) {
  TORCH_CHECK(a_bits.scalar_type() == at::kLong && b_bits.scalar_type() == at::kLong &&
                  a_bits.sizes() == b_bits.sizes(),
              "lpsim: value_words takes two int64 tensors of one shape");
  const RandomSpec r = random_spec(32, seed, offset);
  const ValueKey key = make_value_key(r.seed, r.offset);
  const at::Tensor ac = a_bits.contiguous(), bc = b_bits.contiguous();
  at::Tensor words = at::empty(a_bits.sizes(), a_bits.options());
  const int64_t* ap = ac.const_data_ptr<int64_t>();
  const int64_t* bp = bc.const_data_ptr<int64_t>();
  int64_t* w = words.data_ptr<int64_t>();
  for (int64_t i = 0; i < ac.numel(); ++i) {
    w[i] = value_word(static_cast<uint64_t>(ap[i]), static_cast<uint64_t>(bp[i]), key);
  }
  return words;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lpsim, m) {
  const std::string grid =
      "int keep, int qmin, int emin, bool subnormals, float pos_limit, float neg_limit, "
      "bool saturate, bool has_inf, bool unsigned_zero";
  const std::string mul_grid =
      "int mul_keep, int mul_qmin, int mul_emin, bool mul_subnormals, float mul_pos_limit, "
      "float mul_neg_limit, bool mul_saturate, bool mul_has_inf, bool mul_unsigned_zero";
  const std::string random = "int rounding, int rbits, Tensor seed, int offset";
  const std::string update = grid + ", " + random + ", int randomness";
  const auto def = [&m](const std::string& schema) { m.def(schema.c_str()); };
  def("sr_add(Tensor a, Tensor b, " + update + ") -> Tensor");
  def("sr_add_(Tensor(a!) a, Tensor b, " + update + ") -> ()");
  def("sr_addc(Tensor a, Tensor t1, Tensor t2, float value, bool divide, " + update + ") -> Tensor");
  def("sr_addc_(Tensor(a!) a, Tensor t1, Tensor t2, float value, bool divide, " + update + ") -> ()");
  def("sum_rounded(Tensor x, int outer, int n, int inner, bool cumulative, " + grid + ", " +
      random + ") -> Tensor");
  def("dot_rounded(Tensor a, Tensor b, bool has_mul, " + mul_grid + ", " + grid + ", " + random +
      ") -> Tensor");
  def("value_words(Tensor a_bits, Tensor b_bits, Tensor seed, int offset) -> Tensor");
}

TORCH_LIBRARY_IMPL(lpsim, CPU, m) {
  register_update_ops<add_kernel_cpu, addc_kernel_cpu>(m);
  m.impl("sum_rounded", sum_rounded_cpu);
  m.impl("dot_rounded", dot_rounded_cpu);
  m.impl("value_words", value_words_cpu);
}

}  // namespace lpsim
