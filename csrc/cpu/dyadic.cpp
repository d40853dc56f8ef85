// The dyadic ops: integer arithmetic on mantissas whose values are v * 2^-s (lpsim/dyadic).
// Schemas (a fragment of the lpsim library), argument checks and CPU loops over the integer core
// lpsim/dyadic.h. The scales themselves are bookkept in Python; a kernel receives only the shifts
// they imply. Every loop reads element i's random word from the Philox mapping of lpsim/philox.h,
// so results do not depend on the thread count. The ops that can overflow their result type
// saturate and return how many elements did, and the Python layer turns a count into an error or
// a warning: no overflow is silent.
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
#include <cmath>
#include <cstring>
#include <limits>

#include <lpsim/dyadic.h>
#include <lpsim/philox.h>

#include "cpu/kernels.h"
#include "ops.h"

namespace lpsim {
namespace {

using dyadic::divide_round;
using dyadic::floor_shift;
using dyadic::requantize_value;
using dyadic::saturate;
using dyadic::shift_round;

// Elements per parallel task: a multiple of the random-word group so tasks do not share a group.
constexpr int64_t kGrain = 64 * kGroupSize;

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

// The per-class shifts, checked against the element count.
std::vector<int64_t> class_shifts(at::IntArrayRef shift, int64_t inner, int64_t n) {
  const int64_t classes = static_cast<int64_t>(shift.size());
  TORCH_CHECK(classes >= 1 && inner >= 1 && n % (classes * inner) == 0, "lpsim: ", classes,
              " classes of ", inner, " elements do not tile a tensor of ", n, " elements");
  return shift.vec();
}

template <Rounding R>
using RuleTag = std::integral_constant<Rounding, R>;

// Calls f(RuleTag<R>{}) for the run-time rule, so that each loop is compiled for its own rule
// (nearest ran 1.2x slower than stochastic when the rule was tested per element).
template <class F>
void with_rule(Rounding rule, F&& f) {
  switch (rule) {
    case Rounding::nearest: return f(RuleTag<Rounding::nearest>{});
    case Rounding::down: return f(RuleTag<Rounding::down>{});
    default: return f(RuleTag<Rounding::stochastic>{});
  }
}

// The per-class shifts of an op: one or two tables indexed by class (empty: every shift is 0).
struct ClassShifts {
  std::vector<int64_t> first, second;
  int64_t classes() const { return std::max<int64_t>(1, static_cast<int64_t>(first.size())); }
  int64_t at(const std::vector<int64_t>& table, int64_t c) const {
    return table.empty() ? 0 : table[static_cast<size_t>(c)];
  }
};

// Runs flag = f(i, word, k1, k2, tag) for every element i < n on every thread and returns how
// many flags were set. k1 and k2 are the shifts of the element's class c = (i / inner) % classes,
// word its random word (0 unless the rule is stochastic) and tag the rule's RuleTag.
//
// A task walks its range in runs of one class and reads the run's shifts into locals before the
// inner loop; each task calls its own copy of f, whose captures are pointers and numbers by value.
// Measured on 2^22 int32 elements (requantize, one thread): a division per element for the
// class cost 20 ns an element; reading the shift or captured state through memory inside the
// loop made the compiler reload it after every store of the bool clip mask (a char type may alias
// anything), 1.5x; the loop as written takes about 7 to 10 ns an element.
template <class F>
int64_t count_over(int64_t n, int64_t inner, const ClassShifts& shifts, Rounding rule,
                   const RandomSpec& random, F&& f) {
  const PhiloxKey key = make_philox_key(random.seed, random.offset);
  const int64_t classes = shifts.classes();
  std::atomic<int64_t> total{0};
  with_rule(rule, [&](auto tag) {
    constexpr bool kRandom = decltype(tag)::value == Rounding::stochastic;
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      auto fn = f;
      int64_t mine = 0;
      alignas(64) uint32_t words[kGroupSize];
      int64_t cached = -1;
      for (int64_t start = begin; start < end;) {
        const int64_t run = start / inner;
        const int64_t c = run % classes;
        const int64_t stop = std::min(end, (run + 1) * inner);
        const int64_t k1 = shifts.at(shifts.first, c), k2 = shifts.at(shifts.second, c);
        if constexpr (kRandom) {
          for (int64_t from = start; from < stop;) {
            const int64_t group = from / kGroupSize;
            const int64_t base = group * kGroupSize;
            const int64_t until = std::min(stop, base + kGroupSize);
            if (group != cached) {
              cpu::philox_group(static_cast<uint64_t>(group), key, words);
              cached = group;
            }
            for (int64_t i = from; i < until; ++i) mine += fn(i, words[i - base], k1, k2, tag);
            from = until;
          }
        } else {
          for (int64_t i = start; i < stop; ++i) mine += fn(i, 0u, k1, k2, tag);
        }
        start = stop;
      }
      total += mine;
    });
  });
  return total.load();
}

at::Tensor count_tensor(int64_t count) {
  at::Tensor t = at::empty({}, at::TensorOptions().dtype(at::kLong));
  *t.data_ptr<int64_t>() = count;
  return t;
}

template <class S>
std::pair<int64_t, int64_t> range_of() {
  return {std::numeric_limits<S>::min(), std::numeric_limits<S>::max()};
}

// Calls f(S{}) for the storage type of an int32 or int64 dtype.
template <class F>
void with_mantissa(at::ScalarType dtype, F&& f) {
  if (dtype == at::kInt) return f(int32_t{});
  return f(int64_t{});
}

// ---- requantize and from_float -------------------------------------------------------------

// What requantize and from_float share: the checked arguments, the contiguous input, the shift
// of each class and the two outputs (the mantissa and where the clip fired).
struct Requantization {
  Rounding rule;
  RandomSpec random;
  at::Tensor src, out, clipped;
  std::vector<int64_t> shifts;
  int64_t inner, lo, hi;
};

Requantization prepare(const at::Tensor& in, at::IntArrayRef shift, int64_t inner, int64_t lo,
                       int64_t hi, at::ScalarType dtype, int64_t rounding, int64_t rbits,
                       const at::Tensor& seed, int64_t offset) {
  check_integer_dtype(dtype, lo, hi);
  Requantization r{integer_rounding(rounding), random_spec(rbits, seed, offset), in.contiguous(),
                   {}, {}, {}, inner, lo, hi};
  r.shifts = class_shifts(shift, inner, r.src.numel());
  r.out = at::empty(r.src.sizes(), r.src.options().dtype(dtype));
  r.clipped = at::empty(r.src.sizes(), r.src.options().dtype(at::kBool));
  return r;
}

// out[i] = clip(round(v * 2^-(k + extra))) for read(i, v, extra) and k the class's shift, as O.
template <class O, class Read>
void requantize_into(const Requantization& r, Read read) {
  O* y = r.out.data_ptr<O>();
  bool* c = r.clipped.data_ptr<bool>();
  const int bits = static_cast<int>(r.random.rbits);
  const int64_t lo = r.lo, hi = r.hi;
  count_over(r.src.numel(), r.inner, ClassShifts{r.shifts, {}}, r.rule, r.random,
             [y, c, lo, hi, bits, read](int64_t i, uint32_t word, int64_t k, int64_t, auto tag) {
    int64_t v, extra;
    read(i, v, extra);
    bool clip = false;
    y[i] = static_cast<O>(
        requantize_value(v, k + extra, lo, hi, decltype(tag)::value, word, bits, clip));
    c[i] = clip;
    return clip;
  });
}

std::tuple<at::Tensor, at::Tensor> requantize_cpu(const at::Tensor& v, at::IntArrayRef shift,
                                                  int64_t inner, int64_t lo, int64_t hi,
                                                  at::ScalarType dtype, int64_t rounding,
                                                  int64_t rbits, const at::Tensor& seed,
                                                  int64_t offset) {
  check_mantissa(v, "v");
  const Requantization r = prepare(v, shift, inner, lo, hi, dtype, rounding, rbits, seed, offset);
  with_mantissa(r.src.scalar_type(), [&](auto in_type) {
    using I = decltype(in_type);
    const I* x = r.src.data_ptr<I>();
    with_mantissa(dtype, [&](auto out_type) {
      requantize_into<decltype(out_type)>(r, [x](int64_t i, int64_t& value, int64_t& extra) {
        value = x[i];
        extra = 0;
      });
    });
  });
  return {r.out, r.clipped};
}

// A finite float as sign * m * 2^e with an integer significand m (no rounding: these are its bits).
template <class F>
void decompose(F x, int64_t& m, int64_t& e) {
  if constexpr (sizeof(F) == 4) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    const int64_t field = (u >> 23) & 0xFF;
    m = static_cast<int64_t>(u & 0x7FFFFF) | (field ? int64_t(1) << 23 : 0);
    e = (field ? field : 1) - 150;
    if (u >> 31) m = -m;
  } else {
    uint64_t u;
    std::memcpy(&u, &x, sizeof u);
    const int64_t field = static_cast<int64_t>((u >> 52) & 0x7FF);
    m = static_cast<int64_t>(u & 0xFFFFFFFFFFFFFull) | (field ? int64_t(1) << 52 : 0);
    e = (field ? field : 1) - 1075;
    if (u >> 63) m = -m;
  }
}

std::tuple<at::Tensor, at::Tensor> from_float_cpu(const at::Tensor& x, at::IntArrayRef scale,
                                                  int64_t inner, int64_t lo, int64_t hi,
                                                  at::ScalarType dtype, int64_t rounding,
                                                  int64_t rbits, const at::Tensor& seed,
                                                  int64_t offset) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble,
                   "lpsim: x must be a float32 or float64 tensor, got ", x.scalar_type());
  TORCH_CHECK(x.device().is_cpu(), "lpsim: x must be a CPU tensor");
  for (int64_t s : scale) {
    TORCH_CHECK(s > -(int64_t(1) << 32) && s < (int64_t(1) << 32),
                "lpsim: scales must be in (-2**32, 2**32), got ", s);
  }
  // x * 2^s = m * 2^(e + s): a right shift by -s - e, whose class part is -s.
  std::vector<int64_t> negated(scale.begin(), scale.end());
  for (int64_t& s : negated) s = -s;
  const Requantization r = prepare(x, negated, inner, lo, hi, dtype, rounding, rbits, seed, offset);
  std::atomic<int64_t> not_finite{0};
  std::atomic<int64_t>* bad = &not_finite;
  auto run = [&](auto float_type, auto out_type) {
    const auto* xs = r.src.data_ptr<decltype(float_type)>();
    requantize_into<decltype(out_type)>(r, [xs, bad](int64_t i, int64_t& m, int64_t& e) {
      if (!std::isfinite(xs[i])) {  // 0, unclipped; counted and raised below
        ++*bad;
        m = e = 0;
        return;
      }
      decompose(xs[i], m, e);
      e = -e;
    });
  };
  with_mantissa(dtype, [&](auto out_type) {
    if (r.src.scalar_type() == at::kFloat) return run(float{}, out_type);
    return run(double{}, out_type);
  });
  TORCH_CHECK_VALUE(not_finite.load() == 0, "lpsim: x must be finite, found ", not_finite.load(),
                    " NaN or Inf elements");
  return {r.out, r.clipped};
}

// ---- elementwise arithmetic -----------------------------------------------------------------

void check_pair(const at::Tensor& a, const at::Tensor& b) {
  check_mantissa(a, "a");
  check_mantissa(b, "b");
  TORCH_CHECK(a.sizes() == b.sizes(), "lpsim: a and b must have the same shape, got ", a.sizes(),
              " and ", b.sizes());
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "lpsim: a and b must have the same dtype, got ",
              a.scalar_type(), " and ", b.scalar_type());
}

// Applies result[i] = op(a[i], b[i], word, k1, k2, rule, wide) for int32 operands (wide type
// int64_t) or int64 operands (wide type __int128), saturating to the operands' dtype; returns
// (result, overflows). Shifts per class as count_over.
template <class Op>
std::tuple<at::Tensor, at::Tensor> binary(const at::Tensor& a_in, const at::Tensor& b_in,
                                          int64_t inner, const ClassShifts& shifts, Rounding rule,
                                          const RandomSpec& random, Op&& op) {
  const at::Tensor a = a_in.contiguous(), b = b_in.contiguous();
  at::Tensor out = at::empty(a.sizes(), a.options());
  int64_t overflows = 0;
  with_mantissa(a.scalar_type(), [&](auto storage) {
    using S = decltype(storage);
    using Wide = std::conditional_t<sizeof(S) == 4, int64_t, __int128>;
    const auto [lo, hi] = range_of<S>();
    const S* x = a.data_ptr<S>();
    const S* y = b.data_ptr<S>();
    S* z = out.data_ptr<S>();
    overflows = count_over(a.numel(), inner, shifts, rule, random,
                           [x, y, z, lo, hi, op](int64_t i, uint32_t word, int64_t k1, int64_t k2,
                                                 auto tag) {
      const Wide r = op(Wide(x[i]), Wide(y[i]), word, k1, k2, decltype(tag)::value, Wide{});
      z[i] = static_cast<S>(saturate<Wide>(r, lo, hi));
      return !dyadic::in_range<Wide>(r, lo, hi);
    });
  });
  return {out, count_tensor(overflows)};
}

std::tuple<at::Tensor, at::Tensor> add_cpu(const at::Tensor& a, const at::Tensor& b,
                                           at::IntArrayRef shift_a, at::IntArrayRef shift_b,
                                           int64_t inner, bool subtract, int64_t rounding,
                                           int64_t rbits, const at::Tensor& seed, int64_t offset) {
  check_pair(a, b);
  const Rounding rule = integer_rounding(rounding);
  const RandomSpec random = random_spec(rbits, seed, offset);
  const std::vector<int64_t> ka = class_shifts(shift_a, inner, a.numel());
  const std::vector<int64_t> kb = class_shifts(shift_b, inner, a.numel());
  TORCH_CHECK(ka.size() == kb.size(), "lpsim: shift_a and shift_b must have the same length");
  for (size_t c = 0; c < ka.size(); ++c) {
    // Alignment shifts only the finer operand, so each element uses its random word once.
    TORCH_CHECK(ka[c] >= 0 && kb[c] >= 0 && std::min(ka[c], kb[c]) == 0,
                "lpsim: alignment shifts must be >= 0 with one of each pair 0, got ", ka[c],
                " and ", kb[c]);
  }
  const int bits = static_cast<int>(random.rbits);
  return binary(a, b, inner, ClassShifts{ka, kb}, rule, random,
                [bits, subtract](auto x, auto y, uint32_t word, int64_t shift_a, int64_t shift_b,
                                 Rounding r, auto wide) {
    using W = decltype(wide);
    // Each operand fits int64_t, and so does its rounded shift; the sum needs the wide type.
    const W u = shift_round<int64_t>(static_cast<int64_t>(x), shift_a, r, word, bits);
    const W v = shift_round<int64_t>(static_cast<int64_t>(y), shift_b, r, word, bits);
    return subtract ? W(u - v) : W(u + v);
  });
}

std::tuple<at::Tensor, at::Tensor> mul_cpu(const at::Tensor& a, const at::Tensor& b,
                                           int64_t shift, int64_t rounding, int64_t rbits,
                                           const at::Tensor& seed, int64_t offset) {
  check_pair(a, b);
  TORCH_CHECK(shift >= 0, "lpsim: the product shift must be >= 0, got ", shift);
  const Rounding rule = integer_rounding(rounding);
  const RandomSpec random = random_spec(rbits, seed, offset);
  const int bits = static_cast<int>(random.rbits);
  const int64_t n = std::max<int64_t>(a.numel(), 1);
  return binary(a, b, n, ClassShifts{}, rule, random,
                [shift, bits](auto x, auto y, uint32_t word, int64_t, int64_t, Rounding r,
                              auto wide) {
    using W = decltype(wide);
    return shift_round<W>(W(x * y), shift, r, word, bits);  // |x y| < 2^62 (2^126)
  });
}

std::tuple<at::Tensor, at::Tensor> div_cpu(const at::Tensor& a, const at::Tensor& b,
                                           int64_t shift, int64_t rounding, int64_t rbits,
                                           const at::Tensor& seed, int64_t offset) {
  check_pair(a, b);
  // The shifted dividend must fit the wide type: |a| <= 2^31 (2^63) and 2^(31 + shift) <= 2^62
  // (2^(63 + shift) <= 2^126).
  const int64_t limit = a.scalar_type() == at::kInt ? 31 : 63;
  TORCH_CHECK(shift >= 0 && shift <= limit, "lpsim: the dividend shift must be in [0, ", limit,
              "] for ", a.scalar_type(), " mantissas, got ", shift);
  const Rounding rule = integer_rounding(rounding);
  const RandomSpec random = random_spec(rbits, seed, offset);
  const int bits = static_cast<int>(random.rbits);
  std::atomic<int64_t> zeros{0};
  std::atomic<int64_t>* zero_count = &zeros;
  const int64_t n = std::max<int64_t>(a.numel(), 1);
  auto result = binary(a, b, n, ClassShifts{}, rule, random,
                       [shift, bits, zero_count](auto x, auto y, uint32_t word, int64_t, int64_t,
                                                 Rounding r, auto wide) {
    using W = decltype(wide);
    if (y == 0) {
      ++*zero_count;
      return W(0);
    }
    return divide_round<W>(W(x * (W(1) << shift)), y, r, word, bits);
  });
  TORCH_CHECK_VALUE(zeros.load() == 0, "lpsim: division by zero in ", zeros.load(), " elements");
  return result;
}

// ---- matrix product -------------------------------------------------------------------------

template <class S>
uint64_t max_magnitude(const at::Tensor& t) {
  const S* p = t.data_ptr<S>();
  uint64_t m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) {
    const int64_t v = p[i];
    m = std::max(m, v < 0 ? uint64_t(0) - static_cast<uint64_t>(v) : static_cast<uint64_t>(v));
  }
  return m;
}

// out[i, j] = sum_k a[i, k] b[k, j], exactly, then checked against [lo, hi] (saturating and
// counting). A two's complement accumulator of that range that wraps on overflow ends with the
// right sum exactly when the exact sum lies in the range (the partial sums are right modulo its
// size), so checking the final sum detects every wrong result.
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
  std::atomic<int64_t> overflows{0};
  with_mantissa(a.scalar_type(), [&](auto storage) {
    using S = decltype(storage);
    // |sum| <= max|a| max|b| K: when that is below 2^63 the sums run in int64. Otherwise they run
    // in __int128 (every product of two int64 fits) and count their wrap-arounds, so that
    // sum = wrapped + carries * 2^128 stays exact for any K.
    const unsigned __int128 product =
        static_cast<unsigned __int128>(max_magnitude<S>(a)) * max_magnitude<S>(bt);
    const bool narrow = depth == 0 || product < ((static_cast<unsigned __int128>(1) << 63) /
                                                 static_cast<unsigned __int128>(depth));
    const S* x = a.data_ptr<S>();
    const S* y = bt.data_ptr<S>();
    with_mantissa(dtype, [&](auto out_type) {
      using O = decltype(out_type);
      O* z = out.data_ptr<O>();
      const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, depth * cols));
      at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
        int64_t mine = 0;
        for (int64_t i = begin; i < end; ++i) {
          for (int64_t j = 0; j < cols; ++j) {
            const S* u = x + i * depth;
            const S* v = y + j * depth;
            bool bad;
            int64_t result;
            if (narrow) {
              int64_t sum = 0;
              for (int64_t k = 0; k < depth; ++k) sum += int64_t(u[k]) * int64_t(v[k]);
              bad = !dyadic::in_range<int64_t>(sum, lo, hi);
              result = saturate<int64_t>(sum, lo, hi);
            } else {
              __int128 sum = 0;
              int64_t carries = 0;
              for (int64_t k = 0; k < depth; ++k) {
                const __int128 term = __int128(u[k]) * __int128(v[k]);
                if (__builtin_add_overflow(sum, term, &sum)) carries += term > 0 ? 1 : -1;
              }
              bad = carries != 0 || !dyadic::in_range<__int128>(sum, lo, hi);
              result = carries > 0 ? hi : (carries < 0 ? lo : saturate<__int128>(sum, lo, hi));
            }
            z[i * cols + j] = static_cast<O>(result);
            mine += bad ? 1 : 0;
          }
        }
        overflows += mine;
      });
    });
  });
  return {out, count_tensor(overflows.load())};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(lpsim, m) {
  const std::string random = "int rounding, int rbits, Tensor seed, int offset";
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
