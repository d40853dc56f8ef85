// CPU loops of the dyadic ops (see dyadic.h) over the integer core lpsim/dyadic.h.
#include "cpu/dyadic.h"

#include <lpsim/dyadic.h>
#include <lpsim/philox.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "cpu/loops.h"

namespace lpsim::cpu {
namespace {

using dyadic::divide_round;
using dyadic::requantize_value;
using dyadic::saturate;
using dyadic::shift_round;

template <Rounding R>
using RuleTag = std::integral_constant<Rounding, R>;

// Calls f(RuleTag<R>{}) for the run-time rule (nearest, down or stochastic: the ops check it), so
// that each loop is compiled for its own rule (nearest ran 1.2x slower than stochastic when the
// rule was tested per element).
template <class F>
void with_rule(Rounding rule, F&& f) {
  switch (rule) {
    case Rounding::nearest:
      return f(RuleTag<Rounding::nearest>{});
    case Rounding::down:
      return f(RuleTag<Rounding::down>{});
    default:
      return f(RuleTag<Rounding::stochastic>{});
  }
}

// Calls f(S{}) for the storage type of an integer type.
template <class F>
void with_mantissa(Integer type, F&& f) {
  if (type == Integer::int32) return f(int32_t{});
  return f(int64_t{});
}

template <class S>
std::pair<int64_t, int64_t> range_of() {
  return {std::numeric_limits<S>::min(), std::numeric_limits<S>::max()};
}

// Runs flag = f(i, word, k1, k2, tag) for the elements i in [begin, end) and returns how many
// flags were set. k1 and k2 are the shifts of the element's class, word its random word (0 unless
// the rule is stochastic) and tag the rule's RuleTag.
//
// The loop walks the range in runs of one class and reads the run's shifts into locals before the
// inner loop; f is a copy whose captures are pointers and numbers by value. Measured on 2^22 int32
// elements (requantize, one thread): a division per element for the class cost 20 ns an element;
// reading the shift or captured state through memory inside the loop made the compiler reload it
// after every store of the bool clip mask (a char type may alias anything), 1.5x; the loop as
// written takes about 7 to 10 ns an element.
template <class F>
int64_t count_over(int64_t begin, int64_t end, const ClassShifts& shifts, Rounding rule,
                   const RandomSpec& random, const F& f) {
  const int64_t classes = std::max<int64_t>(1, shifts.classes), inner = shifts.inner;
  int64_t flagged = 0;
  with_rule(rule, [&](auto tag) {
    constexpr bool kRandom = decltype(tag)::value == Rounding::stochastic;
    auto fn = f;
    WordCache words(make_philox_key(random.seed, random.offset));
    for (int64_t start = begin; start < end;) {
      const int64_t run = start / inner;
      const int64_t c = run % classes;
      const int64_t stop = std::min(end, (run + 1) * inner);
      const int64_t k1 = shifts.first != nullptr ? shifts.first[c] : 0;
      const int64_t k2 = shifts.second != nullptr ? shifts.second[c] : 0;
      if constexpr (kRandom) {
        for (int64_t from = start; from < stop;) {
          const int64_t group = from / kGroupSize;
          const int64_t base = group * kGroupSize;
          const int64_t until = std::min(stop, base + kGroupSize);
          const uint32_t* w = words.group(group);
          for (int64_t i = from; i < until; ++i) flagged += fn(i, w[i - base], k1, k2, tag);
          from = until;
        }
      } else {
        for (int64_t i = start; i < stop; ++i) flagged += fn(i, 0u, k1, k2, tag);
      }
      start = stop;
    }
  });
  return flagged;
}

// y[i] = clip(round(v * 2^-(k + extra))) for read(i, v, extra) and k the class's shift, as O.
template <class O, class Read>
int64_t requantize_span(O* y, bool* c, int64_t begin, int64_t end, const ClassShifts& shifts,
                        int64_t lo, int64_t hi, Rounding rule, const RandomSpec& random,
                        Read read) {
  const int bits = static_cast<int>(random.rbits);
  return count_over(
      begin, end, shifts, rule, random,
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

// z[i] = op(a[i], b[i], word, k1, k2, rule, wide) for int32 operands (wide type int64_t) or int64
// operands (wide type __int128), saturated to the operands' type; returns how many saturated.
template <class Op>
int64_t binary(Integer type, const void* a, const void* b, void* z, int64_t begin, int64_t end,
               const ClassShifts& shifts, Rounding rule, const RandomSpec& random, Op op) {
  int64_t overflows = 0;
  with_mantissa(type, [&](auto storage) {
    using S = decltype(storage);
    using Wide = std::conditional_t<sizeof(S) == 4, int64_t, __int128>;
    const auto [lo, hi] = range_of<S>();
    const S* x = static_cast<const S*>(a);
    const S* y = static_cast<const S*>(b);
    S* out = static_cast<S*>(z);
    overflows = count_over(
        begin, end, shifts, rule, random,
        [x, y, out, lo, hi, op](int64_t i, uint32_t word, int64_t k1, int64_t k2, auto tag) {
          const Wide r = op(Wide(x[i]), Wide(y[i]), word, k1, k2, decltype(tag)::value, Wide{});
          out[i] = static_cast<S>(saturate<Wide>(r, lo, hi));
          return !dyadic::in_range<Wide>(r, lo, hi);
        });
  });
  return overflows;
}

// One class for the whole range: the shifts of mul and div are not per class.
ClassShifts no_classes(int64_t end) {
  return ClassShifts{nullptr, nullptr, 1, std::max<int64_t>(end, 1)};
}

}  // namespace

DyadicCounts dyadic_requantize(Integer in, const void* v, Integer out, void* y, bool* clipped,
                               int64_t begin, int64_t end, const ClassShifts& shifts, int64_t lo,
                               int64_t hi, Rounding rule, const RandomSpec& random) {
  DyadicCounts counts;
  with_mantissa(in, [&](auto in_type) {
    using I = decltype(in_type);
    const I* x = static_cast<const I*>(v);
    with_mantissa(out, [&](auto out_type) {
      using O = decltype(out_type);
      counts.flagged =
          requantize_span(static_cast<O*>(y), clipped, begin, end, shifts, lo, hi, rule, random,
                          [x](int64_t i, int64_t& value, int64_t& extra) {
                            value = x[i];
                            extra = 0;
                          });
    });
  });
  return counts;
}

DyadicCounts dyadic_from_float(Dtype in, const void* x, Integer out, void* y, bool* clipped,
                               int64_t begin, int64_t end, const ClassShifts& shifts, int64_t lo,
                               int64_t hi, Rounding rule, const RandomSpec& random) {
  DyadicCounts counts;
  int64_t* bad = &counts.invalid;
  auto run = [&](auto float_type, auto out_type) {
    using O = decltype(out_type);
    const auto* xs = static_cast<const decltype(float_type)*>(x);
    // x * 2^s = m * 2^(e + s): a right shift by -s - e, whose class part is first = -s.
    counts.flagged = requantize_span(
        static_cast<O*>(y), clipped, begin, end, shifts, lo, hi, rule, random,
        [xs, bad](int64_t i, int64_t& m, int64_t& e) {
          if (!std::isfinite(xs[i])) {  // 0, unclipped; counted and refused by the op
            ++*bad;
            m = e = 0;
            return;
          }
          decompose(xs[i], m, e);
          e = -e;
        });
  };
  with_mantissa(out, [&](auto out_type) {
    if (in == Dtype::float32) return run(float{}, out_type);
    return run(double{}, out_type);
  });
  return counts;
}

DyadicCounts dyadic_add(Integer type, const void* a, const void* b, void* z, int64_t begin,
                        int64_t end, const ClassShifts& shifts, bool subtract, Rounding rule,
                        const RandomSpec& random) {
  const int bits = static_cast<int>(random.rbits);
  DyadicCounts counts;
  counts.flagged =
      binary(type, a, b, z, begin, end, shifts, rule, random,
             [bits, subtract](auto x, auto y, uint32_t word, int64_t shift_a, int64_t shift_b,
                              Rounding r, auto wide) {
               using W = decltype(wide);
               // Each operand fits int64_t, and so does its rounded shift; the sum needs the wide
               // type.
               const W u = shift_round<int64_t>(static_cast<int64_t>(x), shift_a, r, word, bits);
               const W v = shift_round<int64_t>(static_cast<int64_t>(y), shift_b, r, word, bits);
               return subtract ? W(u - v) : W(u + v);
             });
  return counts;
}

DyadicCounts dyadic_mul(Integer type, const void* a, const void* b, void* z, int64_t begin,
                        int64_t end, int64_t shift, Rounding rule, const RandomSpec& random) {
  const int bits = static_cast<int>(random.rbits);
  DyadicCounts counts;
  counts.flagged =
      binary(type, a, b, z, begin, end, no_classes(end), rule, random,
             [shift, bits](auto x, auto y, uint32_t word, int64_t, int64_t, Rounding r, auto wide) {
               using W = decltype(wide);
               return shift_round<W>(W(x * y), shift, r, word, bits);  // |x y| < 2^62 (2^126)
             });
  return counts;
}

DyadicCounts dyadic_div(Integer type, const void* a, const void* b, void* z, int64_t begin,
                        int64_t end, int64_t shift, Rounding rule, const RandomSpec& random) {
  const int bits = static_cast<int>(random.rbits);
  DyadicCounts counts;
  int64_t* zeros = &counts.invalid;
  counts.flagged = binary(
      type, a, b, z, begin, end, no_classes(end), rule, random,
      [shift, bits, zeros](auto x, auto y, uint32_t word, int64_t, int64_t, Rounding r, auto wide) {
        using W = decltype(wide);
        if (y == 0) {
          ++*zeros;
          return W(0);
        }
        return divide_round<W>(W(x * (W(1) << shift)), y, r, word, bits);
      });
  return counts;
}

uint64_t dyadic_max_magnitude(Integer type, const void* v, int64_t n) {
  uint64_t m = 0;
  with_mantissa(type, [&](auto storage) {
    using S = decltype(storage);
    const S* p = static_cast<const S*>(v);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t x = p[i];
      m = std::max(m, x < 0 ? uint64_t(0) - static_cast<uint64_t>(x) : static_cast<uint64_t>(x));
    }
  });
  return m;
}

// A two's complement accumulator of [lo, hi] that wraps on overflow ends with the right sum exactly
// when the exact sum lies in the range (the partial sums are right modulo its size), so checking
// the final sum detects every wrong result.
int64_t dyadic_matmul(Integer in, const void* a, const void* bt, Integer out, void* z,
                      int64_t row_begin, int64_t row_end, int64_t depth, int64_t cols, int64_t lo,
                      int64_t hi, bool narrow) {
  int64_t overflows = 0;
  with_mantissa(in, [&](auto storage) {
    using S = decltype(storage);
    const S* x = static_cast<const S*>(a);
    const S* y = static_cast<const S*>(bt);
    with_mantissa(out, [&](auto out_type) {
      using O = decltype(out_type);
      O* result_out = static_cast<O*>(z);
      for (int64_t i = row_begin; i < row_end; ++i) {
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
            // Every product of two int64 fits __int128; the wrap-arounds are counted, so that
            // sum = wrapped + carries * 2^128 stays exact for any depth.
            __int128 sum = 0;
            int64_t carries = 0;
            for (int64_t k = 0; k < depth; ++k) {
              const __int128 term = __int128(u[k]) * __int128(v[k]);
              if (__builtin_add_overflow(sum, term, &sum)) carries += term > 0 ? 1 : -1;
            }
            bad = carries != 0 || !dyadic::in_range<__int128>(sum, lo, hi);
            result = carries > 0 ? hi : (carries < 0 ? lo : saturate<__int128>(sum, lo, hi));
          }
          result_out[i * cols + j] = static_cast<O>(result);
          overflows += bad ? 1 : 0;
        }
      }
    });
  });
  return overflows;
}

}  // namespace lpsim::cpu
