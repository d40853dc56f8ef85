// Statistics of a rounding, the same on the host and the device: what happened to each element x
// of a tensor when it was rounded to y (lpsim/statistics.py documents the categories).
//
// Counts are exact. The two sums are float64 and added in one fixed order whatever the thread
// count or the device: the tensor is cut into chunks of kStatisticsChunk elements; in a chunk,
// lane l (of kStatisticsLanes) adds the elements l, l + kStatisticsLanes, ... in order, then the
// lanes are added pairwise (lane l += lane l + w for w = kStatisticsLanes / 2, ..., 1); the chunks'
// sums are added in chunk order (combine_chunks). A CPU loop runs a lane per vector slot, a CUDA
// block a lane per thread, and both give the same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "config.h"
#include "container.h"
#include "ieee_ops.h"

namespace lpsim {

constexpr int kStatisticsLanes = 256;
constexpr int kStatisticsRows = 64;  // elements per lane in a chunk
constexpr int64_t kStatisticsChunk = int64_t{kStatisticsLanes} * kStatisticsRows;

// Which elements the counts single out: finite x outside [low, high] overflowed; a finite nonzero y
// below smallest_normal in magnitude is subnormal (0: no subnormals counted).
struct StatisticsBounds {
  double low;
  double high;
  double smallest_normal;
};

// The counts of a statistics record, in the order of the op's int64 result (elements first).
enum StatisticsCount : int {
  kElements,
  kNonfinite,
  kOverflow,
  kUnderflow,
  kSubnormal,
  kUnchanged,
  kStatisticsCounts
};

// The statistics of one chunk, or of a whole tensor.
struct ChunkStatistics {
  int64_t counts[kStatisticsCounts];
  double squared_error;  // sum of (y - x)^2 where x and y are finite
  double squared_value;  // sum of x^2 there
};

// The type the counts compare values in: float for the containers of at most 32 bits, whose values
// are floats exactly (a vector then holds twice as many), double for float64. The sums are always
// float64.
template <class C>
using StatisticsReal = std::conditional_t<std::is_same_v<C, Float64Container>, double, float>;

// The value of a container's bits, exactly, as a StatisticsReal<C>.
template <class C>
LPSIM_FN StatisticsReal<C> value_of(typename C::storage bits) {
  if constexpr (std::is_same_v<C, Float64Container>) {
    return real_of(static_cast<uint64_t>(bits));
  } else if constexpr (C::exp_bits == 8) {  // float32, bfloat16: the float32 word's top bits
    return real_of(static_cast<uint32_t>(bits) << (23 - C::man_bits));
  } else {  // float16: rebias the exponent into a float32 word; subnormals scaled exactly
    static_assert(C::exp_bits == 5 && C::man_bits == 10, "an IEEE container");
    const uint32_t sign = (static_cast<uint32_t>(bits) & 0x8000u) << 16;
    const uint32_t magnitude = static_cast<uint32_t>(bits) & 0x7FFFu;
    uint32_t word = (magnitude << 13) + ((127u - 15u) << 23);
    if (magnitude >= 0x7C00u) word = (magnitude << 13) | 0x7F800000u;  // Inf and NaN
    if (magnitude < 0x0400u) {
      word = bits_of_real(static_cast<float>(magnitude) * 0x1p-24f);  // subnormal or zero
    }
    return real_of(word | sign);
  }
}

// StatisticsBounds in the type the values are compared in, rounded outward so that every
// comparison of a Real value gives what the comparison with the double bound gives: x < low for a
// float x exactly when x < the least float >= low, and likewise for high and smallest_normal.
template <class Real>
struct RealBounds {
  Real low;
  Real high;
  Real smallest_normal;
};

// The least Real >= v (v not NaN; +Inf for v beyond the largest finite Real). Host code.
template <class Real>
inline Real at_or_above(double v) {
  const Real r = static_cast<Real>(v);
  return static_cast<double>(r) < v ? std::nextafter(r, static_cast<Real>(INFINITY)) : r;
}
// The greatest Real <= v. Host code.
template <class Real>
inline Real at_or_below(double v) {
  return -at_or_above<Real>(-v);
}

template <class Real>
inline RealBounds<Real> real_bounds(const StatisticsBounds& b) {
  return {at_or_above<Real>(b.low), at_or_below<Real>(b.high),
          at_or_above<Real>(b.smallest_normal)};
}

// One element's share of the statistics: each count 0 or 1, and the two squares.
struct ElementStatistics {
  uint32_t nonfinite, overflow, underflow, subnormal, unchanged;
  double squared_error, squared_value;
};

// The counts of the elements a lane (or a thread) has taken, element by element.
struct StatisticsCounts {
  uint32_t nonfinite, overflow, underflow, subnormal, unchanged;
};

LPSIM_FN void add_counts(StatisticsCounts& c, const ElementStatistics& s) {
  c.nonfinite += s.nonfinite;
  c.overflow += s.overflow;
  c.underflow += s.underflow;
  c.subnormal += s.subnormal;
  c.unchanged += s.unchanged;
}

// a < b without the invalid-operation signal of an ordered comparison with NaN: GCC keeps a
// comparison that may signal out of a branch-free (vectorised) loop under -ftrapping-math.
template <class Real>
LPSIM_FN bool quiet_less(Real a, Real b) {
#if defined(__CUDA_ARCH__)
  return a < b;
#else
  return __builtin_isless(a, b);
#endif
}

template <class Real>
LPSIM_FN ElementStatistics element_statistics(Real x, Real y, const RealBounds<Real>& b) {
  // x - x is 0 for finite x and NaN for NaN and +/-Inf, without a library call. The conditions are
  // combined with & and |, not && and ||, so that the CPU loop has no branches and vectorises.
  const bool x_finite = sub_rn(x, x) == Real(0);
  const bool y_finite = sub_rn(y, y) == Real(0);
  const bool both = x_finite & y_finite;
#if defined(__CUDA_ARCH__)
  const Real y_magnitude = fabs(y);
#else
  const Real y_magnitude = std::fabs(y);
#endif
  const bool overflow = x_finite & (quiet_less(x, b.low) | quiet_less(b.high, x) | !y_finite);
  ElementStatistics s;
  s.nonfinite = !x_finite;
  s.overflow = overflow;
  s.underflow = x_finite & !overflow & (x != Real(0)) & (y == Real(0));
  s.subnormal = both & (y != Real(0)) & quiet_less(y_magnitude, b.smallest_normal);
  s.unchanged = x_finite & (y == x);
  // The operands are selected, not the results: GCC would move an operation whose result is
  // selected into a branch, which a loop cannot vectorise.
  const double value = static_cast<double>(both ? x : Real(0));
  const double error = sub_rn(static_cast<double>(both ? y : Real(0)), value);
  s.squared_error = mul_rn(error, error);
  s.squared_value = mul_rn(value, value);
  return s;
}

// Adds the lanes' sums pairwise into lane 0 (the order the header comment fixes). Host code; the
// CUDA kernel does the same steps in shared memory.
inline double add_lanes(double* lanes) {
  for (int width = kStatisticsLanes / 2; width >= 1; width /= 2) {
    for (int l = 0; l < width; ++l) lanes[l] = add_rn(lanes[l], lanes[l + width]);
  }
  return lanes[0];
}

// The statistics of a tensor from those of its chunks, in chunk order. Host code.
inline ChunkStatistics combine_chunks(const ChunkStatistics* chunks, int64_t count) {
  ChunkStatistics total{};
  for (int64_t c = 0; c < count; ++c) {
    for (int k = 0; k < kStatisticsCounts; ++k) total.counts[k] += chunks[c].counts[k];
    total.squared_error = add_rn(total.squared_error, chunks[c].squared_error);
    total.squared_value = add_rn(total.squared_value, chunks[c].squared_value);
  }
  return total;
}

}  // namespace lpsim
