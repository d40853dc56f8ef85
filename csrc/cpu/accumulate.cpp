// CPU loops of the accumulation ops (see accumulate.h): recursive sums and dot products rounded
// after every operation. Each running sum is a float64 word (every format fits float64, and float64
// holds the exact product of two values of at most 24 significant bits), rounded by the core's
// round_to_grid and round_sum_to_grid onto the accumulation format's grid. The loops are scalar:
// every step depends on the one before (about 30 ns per multiply-add on a 2-core x86 machine).
#include "cpu/accumulate.h"

#include <lpsim/exact_sum.h>
#include <lpsim/mac.h>

#include <type_traits>

#include "cpu/loops.h"
#include "cpu/mac_lanes.h"
#include "cpu/tensor_core_loop.h"
#include "dispatch.h"

namespace lpsim::cpu {
namespace {

template <class C>
typename C::word bits_of(const typename C::storage& s) {
  return static_cast<typename C::word>(s);
}

using F64 = Float64Container;

// The running sum of one reduction, in float64 bits: the first term rounded, then each sum of the
// running value and the next term rounded (both by rule R onto grid g). The empty sum is +0.
template <Rounding R>
struct RoundedSum {
  const Grid<F64>& grid;
  uint32_t mask;
  uint64_t value = 0;
  bool started = false;

  void add(uint64_t term, uint32_t word) {
    value = started ? round_sum_to_grid<R, F64>(value, term, grid, word, mask)
                    : round_to_grid<R, F64>(term, grid, word, mask);
    started = true;
  }
};

template <class X, Rounding R>
void sum_span(const void* xv, uint64_t* y, int64_t n, int64_t inner, int64_t begin, int64_t end,
              bool cumulative, const GridSpec& spec, const RandomSpec& random) {
  const auto* x = static_cast<const typename X::storage*>(xv);
  Grid<F64> g;
  make_grid<F64>(spec, g);
  WordCache words(make_philox_key(random.seed, random.offset));
  const uint32_t mask = random_mask(random.rbits);
  for (int64_t r = begin; r < end; ++r) {
    const int64_t o = r / inner, j = r % inner;
    const typename X::storage* column = x + o * n * inner + j;
    RoundedSum<R> s{g, mask};
    for (int64_t k = 0; k < n; ++k) {
      const int64_t event = 2 * (r * n + k);
      s.add(convert_exact<F64, X>(bits_of<X>(column[k * inner])),
            is_stochastic(R) ? words(event) : 0);
      if (cumulative) y[(o * n + k) * inner + j] = s.value;
    }
    if (!cumulative) y[r] = s.value;
  }
}

template <class X, Rounding R>
void dot_span(const void* av, const void* bv, uint64_t* y, int64_t n, int64_t p, int64_t begin,
              int64_t end, const GridSpec* mul, const GridSpec& acc, const RandomSpec& random) {
  const auto* a = static_cast<const typename X::storage*>(av);
  const auto* b = static_cast<const typename X::storage*>(bv);
  Grid<F64> acc_grid, mul_grid;
  make_grid<F64>(acc, acc_grid);
  if (mul != nullptr) make_grid<F64>(*mul, mul_grid);
  WordCache words(make_philox_key(random.seed, random.offset));
  const uint32_t mask = random_mask(random.rbits);
  for (int64_t r = begin; r < end; ++r) {
    const typename X::storage* row = a + (r / p) * n;
    const typename X::storage* column = b + (r % p) * n;
    RoundedSum<R> s{acc_grid, mask};
    for (int64_t k = 0; k < n; ++k) {
      const int64_t event = 2 * (r * n + k);
      uint64_t product = exact_product<X>(bits_of<X>(row[k]), bits_of<X>(column[k]));
      if (mul != nullptr) {
        product =
            round_to_grid<R, F64>(product, mul_grid, is_stochastic(R) ? words(event + 1) : 0, mask);
      }
      s.add(product, is_stochastic(R) ? words(event) : 0);
    }
    y[r] = s.value;
  }
}

template <class X, Rounding R>
void mac_span(const void* av, const void* bv, uint64_t* y, int64_t n, int64_t p, int64_t begin,
              int64_t end, const MacShape& shape, const GridSpec* product, const GridSpec& acc,
              const GridSpec& inner, const RandomSpec& random) {
  const auto* a = static_cast<const typename X::storage*>(av);
  const auto* b = static_cast<const typename X::storage*>(bv);
  Grid<F64> acc_grid, inner_grid, product_grid;
  make_grid<F64>(acc, acc_grid);
  make_grid<F64>(inner, inner_grid);
  if (product != nullptr) make_grid<F64>(*product, product_grid);
  WordCache words(make_philox_key(random.seed, random.offset));
  const uint32_t mask = random_mask(random.rbits);
  for (int64_t r = begin; r < end; ++r) {
    const typename X::storage* row = a + (r / p) * n;
    const typename X::storage* column = b + (r % p) * n;
    MacSum<R, WordCache> s(shape, product != nullptr ? &product_grid : nullptr, acc_grid,
                           inner_grid, mask, words, kMacWordsPerTerm * r * n);
    for (int64_t k = 0; k < n; ++k) {
      s.template add_operands<X>(bits_of<X>(row[k]), bits_of<X>(column[k]), k);
    }
    y[r] = s.finish(n);
  }
}

}  // namespace

void sum_rounded(Dtype x_dtype, Rounding rounding, const void* x, uint64_t* y, int64_t n,
                 int64_t inner, int64_t begin, int64_t end, bool cumulative, const GridSpec& acc,
                 const RandomSpec& random) {
  with_container(x_dtype, [&](auto cx) {
    with_rounding(rounding, [&](auto rule) {
      sum_span<decltype(cx), decltype(rule)::value>(x, y, n, inner, begin, end, cumulative, acc,
                                                    random);
    });
  });
}

void dot_rounded(Dtype x_dtype, Rounding rounding, const void* a, const void* b, uint64_t* y,
                 int64_t n, int64_t p, int64_t begin, int64_t end, const GridSpec* mul,
                 const GridSpec& acc, const RandomSpec& random) {
  with_container(x_dtype, [&](auto cx) {
    using X = decltype(cx);
    if constexpr (!std::is_same_v<X, F64>) {  // float64 products are not exact (checked by the op)
      with_rounding(rounding, [&](auto rule) {
        dot_span<X, decltype(rule)::value>(a, b, y, n, p, begin, end, mul, acc, random);
      });
    }
  });
}

void mac_matmul(Dtype x_dtype, Rounding rounding, const void* a, const void* b, uint64_t* y,
                int64_t n, int64_t p, int64_t begin, int64_t end, const MacShape& shape,
                const GridSpec* product, const GridSpec& acc, const GridSpec& inner,
                const RandomSpec& random) {
  // The sequential sums go through the lane loop (mac_lanes.h), which gives the same bits, and the
  // tensor cores with deterministic rules through their loop (tensor_core_loop.h).
  if (mac_matmul_lanes(x_dtype, rounding, a, b, y, n, p, begin, end, shape, product, acc, random) ||
      mac_matmul_tensor_core(x_dtype, rounding, a, b, y, n, p, begin, end, shape, product, acc,
                             inner)) {
    return;
  }
  with_container(x_dtype, [&](auto cx) {
    using X = decltype(cx);
    if constexpr (!std::is_same_v<X, F64>) {  // float64 products are not exact (checked by the op)
      with_rounding(rounding, [&](auto rule) {
        mac_span<X, decltype(rule)::value>(a, b, y, n, p, begin, end, shape, product, acc, inner,
                                           random);
      });
    }
  });
}

}  // namespace lpsim::cpu
