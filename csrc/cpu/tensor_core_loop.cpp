// The tensor-core loop of mac_matmul (see tensor_core_loop.h for the design).
#include "cpu/tensor_core_loop.h"

#include <lpsim/exact_sum.h>
#include <lpsim/mac.h>
#include <lpsim/tensor_core.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu/float64_operands.h"
#include "cpu/loops.h"
#include "cpu/mac_lanes.h"
#include "dispatch.h"

namespace lpsim::cpu {
namespace {

using F64 = Float64Container;

// The alignment exponent of a zero operand: a product with one has an exponent sum below
// kNoProduct, which no nonzero product reaches (operand exponents lie in [-1100, 1100]).
constexpr int32_t kZeroOperand = -(1 << 28);
constexpr int32_t kNoProduct = -(1 << 27);

// Operands in float64 with their alignment exponents, `count` vectors of n.
struct Operands {
  std::vector<double> value;
  std::vector<int32_t> exponent;
};

// Converts `count` vectors of n operands; false if one is an Inf or NaN.
template <class X>
LPSIM_INLINE bool convert(const typename X::storage* x, int64_t count, int64_t n, int32_t emin,
                          Operands& out) {
  out.value.resize(static_cast<size_t>(count * n));
  out.exponent.resize(static_cast<size_t>(count * n));
  bool finite = true;
  for (int64_t i = 0; i < count * n; ++i) {
    const double v = as_double<X>(x[i]);
    const uint64_t u = bits_of_real(v);
    finite &= (u & F64::abs_mask) < F64::inf_bits;
    out.value[i] = v;
    out.exponent[i] = (u & F64::abs_mask) == 0 ? kZeroOperand : operand_exponent(u, emin);
  }
  return finite;
}

// One result's operands: row i of a and column l of b, n terms each.
struct Pair {
  const double* a;
  const int32_t* ae;
  const double* b;
  const int32_t* be;
};

// One step: terms [k0, k1) of the pair and the incoming value c into the next value of grid g,
// tensor_core_step's bits, for the tensor core's normalisation N (spec.normalise).
template <Rounding N>
LPSIM_INLINE uint64_t step(const TensorCoreSpec& core, const Pair& t, int64_t k0, int64_t k1,
                           uint64_t c, const Grid<F64>& g) {
  const uint64_t c_mag = c & F64::abs_mask;
  int32_t top_product = kNoProduct;
  for (int64_t k = k0; k < k1; ++k) top_product = std::max(top_product, t.ae[k] + t.be[k]);
  const bool some_term = top_product > kNoProduct || c_mag != 0;
  int32_t q = 0;
  if (some_term && c_mag < F64::inf_bits) {
    int32_t top = core.exponent_floor;
    if (c_mag != 0) top = max_of(top, operand_exponent(c, kAccumulatorEmin));
    if (top_product > kNoProduct) top = max_of(top, top_product);
    q = top - core.fraction_bits;
  }
  if (!some_term || c_mag >= F64::inf_bits || !tensor_core_weight_in_float64(q)) {
    // No nonzero term, Inf or NaN coming in, or weights outside float64's normal range: the core.
    TensorCoreGroup group;
    for (int64_t k = k0; k < k1; ++k) {
      group.add(bits_of_real(t.a[k] * t.b[k]), bits_of_real(t.a[k]), bits_of_real(t.b[k]),
                core.operand_emin);
    }
    return tensor_core_step(core, group, c, g, 0, 0);
  }
  const double down = pow2_double(-q);
  // Four partial sums, for the vectoriser: every partial sum is exact, so the order is free.
  double partial[4] = {std::trunc(real_of(c) * down), 0, 0, 0};
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    for (int j = 0; j < 4; ++j) partial[j] += std::trunc(t.a[k + j] * t.b[k + j] * down);
  }
  for (; k < k1; ++k) partial[0] += std::trunc(t.a[k] * t.b[k] * down);
  const double sum = (partial[0] + partial[1]) + (partial[2] + partial[3]);
  return tensor_core_result<N>(sum, q, g);
}

// The chain of steps over the groups of terms [k0, k1) (k0 on a group boundary), from c: the next
// value of grid g after each group. The same for every operand container and rule of the results,
// so it is compiled once per clone, out of line, with the normalisation chosen once per chain;
// inlined into each of the loops (with the normalisation chosen per group, ten roundings each
// time) it made this file take over ten minutes to compile.
LPSIM_MULTIVERSION __attribute__((noinline)) uint64_t chain(const TensorCoreSpec& core,
                                                            const Pair& t, int64_t k0, int64_t k1,
                                                            uint64_t c, const Grid<F64>& g) {
  with_rounding(core.normalise, [&](auto rule) LPSIM_LAMBDA_INLINE {
    constexpr Rounding N = decltype(rule)::value;
    if constexpr (!is_stochastic(N)) {  // mac_matmul_tensor_core takes no stochastic one
      for (int64_t k = k0; k < k1; k += core.group) {
        c = step<N>(core, t, k, std::min(k1, k + core.group), c, g);
      }
    }
  });
  return c;
}

// MacSum's chain of groups for one result (its close_group, close_chunk and finish), rule R for
// the chunks' additions into the accumulator. A chunk is a whole number of groups (the op checks).
template <Rounding R>
LPSIM_INLINE uint64_t result(const MacShape& shape, const Pair& t, int64_t n, const Grid<F64>& acc,
                             const Grid<F64>& inner) {
  if (n == 0) return 0;
  const TensorCoreSpec& core = shape.tensor_core;
  if (shape.order != MacOrder::kChunked) return chain(core, t, 0, n, 0, acc);
  uint64_t sum = 0;
  for (int64_t k0 = 0; k0 < n; k0 += shape.chunk) {
    const uint64_t chunk_sum = chain(core, t, k0, std::min(n, k0 + shape.chunk), 0, inner);
    sum = k0 == 0 ? round_to_grid<R, F64>(chunk_sum, acc, 0, 0)
                  : round_sum_to_grid<R, F64>(sum, chunk_sum, acc, 0, 0);
  }
  return sum;
}

template <class X, Rounding R>
LPSIM_INLINE bool tensor_core_span(const void* av, const void* bv, uint64_t* y, int64_t n,
                                   int64_t p, int64_t begin, int64_t end, const MacShape& shape,
                                   const GridSpec& acc, const GridSpec& inner) {
  using S = typename X::storage;
  const int32_t emin = shape.tensor_core.operand_emin;
  const int64_t first_row = begin / p, rows = (end - 1) / p - first_row + 1;
  Operands a, b;
  if (!convert<X>(static_cast<const S*>(av) + first_row * n, rows, n, emin, a) ||
      !convert<X>(static_cast<const S*>(bv), p, n, emin, b)) {
    return false;
  }
  Grid<F64> acc_grid, inner_grid;
  make_grid<F64>(acc, acc_grid);
  make_grid<F64>(inner, inner_grid);
  for (int64_t r = begin; r < end; ++r) {
    const int64_t i = r / p - first_row, l = r % p;
    const Pair t{a.value.data() + i * n, a.exponent.data() + i * n, b.value.data() + l * n,
                 b.exponent.data() + l * n};
    y[r] = result<R>(shape, t, n, acc_grid, inner_grid);
  }
  return true;
}

// The loops, compiled for AVX2 and for the baseline (loops.h).
LPSIM_MULTIVERSION
bool tensor_core_results(Dtype x_dtype, Rounding rounding, const void* a, const void* b,
                         uint64_t* y, int64_t n, int64_t p, int64_t begin, int64_t end,
                         const MacShape& shape, const GridSpec& acc, const GridSpec& inner) {
  bool done = false;
  with_container(x_dtype, [&](auto cx) LPSIM_LAMBDA_INLINE {
    using X = decltype(cx);
    if constexpr (!std::is_same_v<X, F64>) {
      with_rounding(rounding, [&](auto rule) LPSIM_LAMBDA_INLINE {
        constexpr Rounding R = decltype(rule)::value;
        if constexpr (!is_stochastic(R)) {
          done = tensor_core_span<X, R>(a, b, y, n, p, begin, end, shape, acc, inner);
        }
      });
    }
  });
  return done;
}

}  // namespace

bool mac_matmul_tensor_core(Dtype x_dtype, Rounding rounding, const void* a, const void* b,
                            uint64_t* y, int64_t n, int64_t p, int64_t begin, int64_t end,
                            const MacShape& shape, const GridSpec* product, const GridSpec& acc,
                            const GridSpec& inner) {
  const TensorCoreSpec& core = shape.tensor_core;
  if (!mac_lanes_enabled() || core.group == 0 || shape.compensated || product != nullptr ||
      is_stochastic(rounding) || is_stochastic(core.normalise) ||
      !tensor_core_sums_in_float64(core) || x_dtype == Dtype::float64 || end <= begin) {
    return false;
  }
  return tensor_core_results(x_dtype, rounding, a, b, y, n, p, begin, end, shape, acc, inner);
}

}  // namespace lpsim::cpu
