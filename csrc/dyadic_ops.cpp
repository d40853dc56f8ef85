// The dyadic ops: integer arithmetic on mantissas whose values are v * 2^-s (lpsim/dyadic).
// Schemas (a fragment of the lpsim library), argument checks, and the torch glue around the CPU
// loops (cpu/dyadic.h) over the integer core lpsim/dyadic.h. The scales themselves are bookkept in
// Python; a kernel receives only the shifts they imply. The ops that can overflow their result
// type saturate and return how many elements did, and the Python layer turns a count into an
// error or a warning: no overflow is silent.
//
//   dyadic_requantize  clip(round(v * 2^-shift[c]), lo, hi) per class c; -> (mantissa, clipped)
//   dyadic_from_float  clip(round(x * 2^scale[c]), lo, hi) from the float's exact bits
//   dyadic_add         round(a * 2^-shift_a[c]) +/- round(b * 2^-shift_b[c]); -> (sum, overflows)
//   dyadic_mul         round(a * b * 2^-shift); -> (product, overflows)
//   dyadic_div         round(a * 2^shift / b); -> (quotient, overflows)
//   dyadic_matmul      exact sum of products, then a range check against [lo, hi]
//
// Class c of element i (row-major) is (i / inner) % classes, classes = shift.size(): one class is
// a per-tensor scale, one class per index along a dimension a per-channel scale.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <string>
#include <vector>

#include "checks.h"
#include "cpu/dyadic.h"
#include "cpu/loops.h"
#include "parallel.h"

namespace lpsim {
namespace {

// ---- Checks

Rounding integer_rounding(int64_t code) {
  const Rounding r = rounding_of(code);
  TORCH_CHECK(r == Rounding::nearest || r == Rounding::down || r == Rounding::stochastic,
              "lpsim: dyadic ops round by nearest, down or stochastic, got code ", code);
  return r;
}

void check_mantissa(const at::Tensor& v, const char* name) {
  TORCH_CHECK_TYPE(v.scalar_type() == at::kInt || v.scalar_type() == at::kLong, "lpsim: ", name,
                   " must be an int32 or int64 tensor, got ", v.scalar_type());
  TORCH_CHECK(v.device().is_cpu(), "lpsim: ", name, " must be a CPU tensor");
}

void check_integer_dtype(at::ScalarType dtype, int64_t lo, int64_t hi) {
  TORCH_CHECK_TYPE(dtype == at::kInt || dtype == at::kLong,
                   "lpsim: dtype must be torch.int32 or torch.int64, got ", dtype);
  const bool fits = dtype == at::kLong || (lo >= std::numeric_limits<int32_t>::min() &&
                                           hi <= std::numeric_limits<int32_t>::max());
  TORCH_CHECK(lo <= 0 && 0 <= hi && fits, "lpsim: the range [", lo, ", ", hi,
              "] must contain 0 and fit ", dtype);
}

void check_pair(const at::Tensor& a, const at::Tensor& b) {
  check_mantissa(a, "a");
  check_mantissa(b, "b");
  TORCH_CHECK(a.sizes() == b.sizes(), "lpsim: a and b must have the same shape, got ", a.sizes(),
              " and ", b.sizes());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "lpsim: a and b must have the same dtype, got ",
              a.scalar_type(), " and ", b.scalar_type());
}

// The per-class shifts, checked against the element count.
std::vector<int64_t> class_shifts(at::IntArrayRef shift, int64_t inner, int64_t n) {
  const int64_t classes = static_cast<int64_t>(shift.size());
  TORCH_CHECK(classes >= 1 && inner >= 1 && n % (classes * inner) == 0, "lpsim: ", classes,
              " classes of ", inner, " elements do not tile a tensor of ", n, " elements");
  return shift.vec();
}

Integer integer_of(at::ScalarType dtype) {
  return dtype == at::kInt ? Integer::int32 : Integer::int64;  // checked by the caller
}

at::Tensor count_tensor(int64_t count) {
  at::Tensor t = at::empty({}, at::TensorOptions().dtype(at::kLong));
  *t.data_ptr<int64_t>() = count;
  return t;
}

// Runs loop(begin, end) -> DyadicCounts over [0, n) on every thread, in tasks that start on a
// random-word group boundary, and adds up the counts.
template <class Loop>
cpu::DyadicCounts run_parallel(int64_t n, Loop&& loop) {
  std::atomic<int64_t> flagged{0}, invalid{0};
  lpsim::parallel_for(0, n, cpu::kGrain, [&](int64_t begin, int64_t end) {
    const cpu::DyadicCounts mine = loop(begin, end);
    flagged += mine.flagged;
    invalid += mine.invalid;
  });
  cpu::DyadicCounts total;
  total.flagged = flagged.load();
  total.invalid = invalid.load();
  return total;
}

// ---- requantize and from_float

std::tuple<at::Tensor, at::Tensor> requantize_cpu(const at::Tensor& v, at::IntArrayRef shift,
                                                  int64_t inner, int64_t lo, int64_t hi,
                                                  at::ScalarType dtype, int64_t rounding,
                                                  int64_t rbits, const Seed& seed, int64_t offset) {
  check_mantissa(v, "v");
  check_integer_dtype(dtype, lo, hi);
  const Rounding rule = integer_rounding(rounding);
  const RandomSpec random = random_spec(rule, rbits, seed, offset);
  const at::Tensor src = v.contiguous();
  const std::vector<int64_t> shifts = class_shifts(shift, inner, src.numel());
  at::Tensor out = at::empty(src.sizes(), src.options().dtype(dtype));
  at::Tensor clipped = at::empty(src.sizes(), src.options().dtype(at::kBool));
  const cpu::ClassShifts classes{shifts.data(), nullptr, static_cast<int64_t>(shifts.size()),
                                 inner};
  const Integer in_type = integer_of(src.scalar_type()), out_type = integer_of(dtype);
  const void* x = src.const_data_ptr();
  void* y = out.data_ptr();
  bool* c = clipped.data_ptr<bool>();
  run_parallel(src.numel(), [&](int64_t begin, int64_t end) {
    return cpu::dyadic_requantize(in_type, x, out_type, y, c, begin, end, classes, lo, hi, rule,
                                  random);
  });
  return {out, clipped};
}

std::tuple<at::Tensor, at::Tensor> from_float_cpu(const at::Tensor& x, at::IntArrayRef scale,
                                                  int64_t inner, int64_t lo, int64_t hi,
                                                  at::ScalarType dtype, int64_t rounding,
                                                  int64_t rbits, const Seed& seed, int64_t offset) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble,
                   "lpsim: x must be a float32 or float64 tensor, got ", x.scalar_type());
  TORCH_CHECK(x.device().is_cpu(), "lpsim: x must be a CPU tensor");
  for (int64_t s : scale) {
    TORCH_CHECK(s > -(int64_t(1) << 32) && s < (int64_t(1) << 32),
                "lpsim: scales must be in (-2**32, 2**32), got ", s);
  }
  check_integer_dtype(dtype, lo, hi);
  const Rounding rule = integer_rounding(rounding);
  const RandomSpec random = random_spec(rule, rbits, seed, offset);
  const at::Tensor src = x.contiguous();
  // x * 2^s is a right shift by -s of x's exact bits: the class part of the shift is -s.
  std::vector<int64_t> shifts = class_shifts(scale, inner, src.numel());
  for (int64_t& s : shifts) s = -s;
  at::Tensor out = at::empty(src.sizes(), src.options().dtype(dtype));
  at::Tensor clipped = at::empty(src.sizes(), src.options().dtype(at::kBool));
  const cpu::ClassShifts classes{shifts.data(), nullptr, static_cast<int64_t>(shifts.size()),
                                 inner};
  const Dtype in_type = src.scalar_type() == at::kFloat ? Dtype::float32 : Dtype::float64;
  const Integer out_type = integer_of(dtype);
  const void* xp = src.const_data_ptr();
  void* y = out.data_ptr();
  bool* c = clipped.data_ptr<bool>();
  const cpu::DyadicCounts counts = run_parallel(src.numel(), [&](int64_t begin, int64_t end) {
    return cpu::dyadic_from_float(in_type, xp, out_type, y, c, begin, end, classes, lo, hi, rule,
                                  random);
  });
  TORCH_CHECK_VALUE(counts.invalid == 0, "lpsim: x must be finite, found ", counts.invalid,
                    " NaN or Inf elements");
  return {out, clipped};
}

// ---- elementwise arithmetic

std::tuple<at::Tensor, at::Tensor> add_cpu(const at::Tensor& a, const at::Tensor& b,
                                           at::IntArrayRef shift_a, at::IntArrayRef shift_b,
                                           int64_t inner, bool subtract, int64_t rounding,
                                           int64_t rbits, const Seed& seed, int64_t offset) {
  check_pair(a, b);
  const Rounding rule = integer_rounding(rounding);
  const RandomSpec random = random_spec(rule, rbits, seed, offset);
  const std::vector<int64_t> ka = class_shifts(shift_a, inner, a.numel());
  const std::vector<int64_t> kb = class_shifts(shift_b, inner, a.numel());
  TORCH_CHECK(ka.size() == kb.size(), "lpsim: shift_a and shift_b must have the same length");
  for (size_t c = 0; c < ka.size(); ++c) {
    // Alignment shifts only the finer operand, so each element uses its random word once.
    TORCH_CHECK(ka[c] >= 0 && kb[c] >= 0 && std::min(ka[c], kb[c]) == 0,
                "lpsim: alignment shifts must be >= 0 with one of each pair 0, got ", ka[c],
                " and ", kb[c]);
  }
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor out = at::empty(ac.sizes(), ac.options());
  const cpu::ClassShifts classes{ka.data(), kb.data(), static_cast<int64_t>(ka.size()), inner};
  const Integer type = integer_of(ac.scalar_type());
  const void* x = ac.const_data_ptr();
  const void* y = bc.const_data_ptr();
  void* z = out.data_ptr();
  const cpu::DyadicCounts counts = run_parallel(ac.numel(), [&](int64_t begin, int64_t end) {
    return cpu::dyadic_add(type, x, y, z, begin, end, classes, subtract, rule, random);
  });
  return {out, count_tensor(counts.flagged)};
}

std::tuple<at::Tensor, at::Tensor> mul_cpu(const at::Tensor& a, const at::Tensor& b, int64_t shift,
                                           int64_t rounding, int64_t rbits, const Seed& seed,
                                           int64_t offset) {
  check_pair(a, b);
  TORCH_CHECK(shift >= 0, "lpsim: the product shift must be >= 0, got ", shift);
  const Rounding rule = integer_rounding(rounding);
  const RandomSpec random = random_spec(rule, rbits, seed, offset);
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor out = at::empty(ac.sizes(), ac.options());
  const Integer type = integer_of(ac.scalar_type());
  const void* x = ac.const_data_ptr();
  const void* y = bc.const_data_ptr();
  void* z = out.data_ptr();
  const cpu::DyadicCounts counts = run_parallel(ac.numel(), [&](int64_t begin, int64_t end) {
    return cpu::dyadic_mul(type, x, y, z, begin, end, shift, rule, random);
  });
  return {out, count_tensor(counts.flagged)};
}

std::tuple<at::Tensor, at::Tensor> div_cpu(const at::Tensor& a, const at::Tensor& b, int64_t shift,
                                           int64_t rounding, int64_t rbits, const Seed& seed,
                                           int64_t offset) {
  check_pair(a, b);
  // The shifted dividend must fit the wide type: |a| <= 2^31 (2^63) and 2^(31 + shift) <= 2^62
  // (2^(63 + shift) <= 2^126).
  const int64_t limit = a.scalar_type() == at::kInt ? 31 : 63;
  TORCH_CHECK(shift >= 0 && shift <= limit, "lpsim: the dividend shift must be in [0, ", limit,
              "] for ", a.scalar_type(), " mantissas, got ", shift);
  const Rounding rule = integer_rounding(rounding);
  const RandomSpec random = random_spec(rule, rbits, seed, offset);
  const at::Tensor ac = a.contiguous(), bc = b.contiguous();
  at::Tensor out = at::empty(ac.sizes(), ac.options());
  const Integer type = integer_of(ac.scalar_type());
  const void* x = ac.const_data_ptr();
  const void* y = bc.const_data_ptr();
  void* z = out.data_ptr();
  const cpu::DyadicCounts counts = run_parallel(ac.numel(), [&](int64_t begin, int64_t end) {
    return cpu::dyadic_div(type, x, y, z, begin, end, shift, rule, random);
  });
  TORCH_CHECK_VALUE(counts.invalid == 0, "lpsim: division by zero in ", counts.invalid,
                    " elements");
  return {out, count_tensor(counts.flagged)};
}

// ---- matrix product

// out[i, j] = sum_k a[i, k] b[k, j], exactly, then checked against [lo, hi] (saturating and
// counting; see cpu::dyadic_matmul).
std::tuple<at::Tensor, at::Tensor> matmul_cpu(const at::Tensor& a_in, const at::Tensor& b_in,
                                              int64_t lo, int64_t hi) {
  check_mantissa(a_in, "a");
  check_mantissa(b_in, "b");
  TORCH_CHECK(a_in.dim() == 2 && b_in.dim() == 2 && a_in.size(1) == b_in.size(0),
              "lpsim: matmul needs (N, K) and (K, M) matrices, got ", a_in.sizes(), " and ",
              b_in.sizes());
  TORCH_CHECK(a_in.scalar_type() == b_in.scalar_type(),
              "lpsim: a and b must have the same dtype, got ", a_in.scalar_type(), " and ",
              b_in.scalar_type());
  const at::ScalarType dtype =
      lo >= std::numeric_limits<int32_t>::min() && hi <= std::numeric_limits<int32_t>::max()
          ? at::kInt
          : at::kLong;
  check_integer_dtype(dtype, lo, hi);
  const at::Tensor a = a_in.contiguous();
  const at::Tensor bt = b_in.t().contiguous();  // (M, K): each dot product reads two rows
  const int64_t rows = a.size(0), depth = a.size(1), cols = bt.size(0);
  at::Tensor out = at::empty({rows, cols}, a.options().dtype(dtype));
  const Integer in_type = integer_of(a.scalar_type()), out_type = integer_of(dtype);
  // |sum| <= max|a| max|b| K: when that is below 2^63 the sums run in int64, else in 128 bits.
  const unsigned __int128 product =
      static_cast<unsigned __int128>(
          cpu::dyadic_max_magnitude(in_type, a.const_data_ptr(), a.numel())) *
      cpu::dyadic_max_magnitude(in_type, bt.const_data_ptr(), bt.numel());
  const bool narrow = depth == 0 || product < ((static_cast<unsigned __int128>(1) << 63) /
                                               static_cast<unsigned __int128>(depth));
  const void* x = a.const_data_ptr();
  const void* y = bt.const_data_ptr();
  void* z = out.data_ptr();
  std::atomic<int64_t> overflows{0};
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, depth * cols));
  lpsim::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    overflows +=
        cpu::dyadic_matmul(in_type, x, y, out_type, z, begin, end, depth, cols, lo, hi, narrow);
  });
  return {out, count_tensor(overflows.load())};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lpsim, m) {
  const std::string random = kRandomSchema;
  const auto def = [&m](const std::string& schema) { m.def(schema.c_str()); };
  def("dyadic_requantize(Tensor v, int[] shift, int inner, int lo, int hi, ScalarType dtype, " +
      random + ") -> (Tensor, Tensor)");
  def("dyadic_from_float(Tensor x, int[] scale, int inner, int lo, int hi, ScalarType dtype, " +
      random + ") -> (Tensor, Tensor)");
  def("dyadic_add(Tensor a, Tensor b, int[] shift_a, int[] shift_b, int inner, bool subtract, " +
      random + ") -> (Tensor, Tensor)");
  def("dyadic_mul(Tensor a, Tensor b, int shift, " + random + ") -> (Tensor, Tensor)");
  def("dyadic_div(Tensor a, Tensor b, int shift, " + random + ") -> (Tensor, Tensor)");
  def("dyadic_matmul(Tensor a, Tensor b, int lo, int hi) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(lpsim, CPU, m) {
  m.impl("dyadic_requantize", requantize_cpu);
  m.impl("dyadic_from_float", from_float_cpu);
  m.impl("dyadic_add", add_cpu);
  m.impl("dyadic_mul", mul_cpu);
  m.impl("dyadic_div", div_cpu);
  m.impl("dyadic_matmul", matmul_cpu);
}

}  // namespace lpsim
