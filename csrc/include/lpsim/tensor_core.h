// One step of a tensor-core model (lpsim/mac.py's TensorCore): a group of exact products and the
// incoming accumulator value c, each aligned to the group's largest exponent E and truncated toward
// zero to the multiples of 2^(E - F), summed exactly, and normalised once onto the accumulator's
// grid. Values are float64 words, as in mac.h.
//
// The step is integer arithmetic: each term becomes a signed multiple of 2^(E - F), at most
// 2^(F + 2) in magnitude (a product's significand lies in [0, 4), c's in [0, 2)), so a group of
// kMaxTensorCoreGroup products and c sums in an int64 for F <= kMaxFractionBits. The exact sum
// S 2^(E - F) is split into two float64 words, hi + lo, and rounded once by round_sum_to_grid.
#pragma once

#include <cstdint>

#include "config.h"
#include "container.h"
#include "exact_sum.h"
#include "grid_spec.h"
#include "ieee_ops.h"
#include "round.h"
#include "rounding.h"

namespace lpsim {

constexpr int kMaxTensorCoreGroup = 128;  // products per step
constexpr int kMaxFractionBits = 52;      // (F + 2) + log2(group + 1) < 63
constexpr int32_t kNoExponentFloor = INT32_MIN;
constexpr int32_t kAccumulatorEmin = -126;  // c is held as a binary32 value (see exponent_of_sum)

// A tensor core's fields (lpsim.mac.TensorCore).
struct TensorCoreSpec {
  int32_t group;           // products per step, in [1, kMaxTensorCoreGroup]
  int32_t fraction_bits;   // F: bits kept below the largest exponent, in [0, kMaxFractionBits]
  int32_t exponent_floor;  // E is at least this (kNoExponentFloor: no floor)
  int32_t operand_emin;    // exponent of an operand's subnormals (its format's emin)
  Rounding normalise;      // the rule of the group sum's rounding onto the accumulator
};

// floor(log2 |v|) of a finite nonzero float64 word.
LPSIM_FN int32_t float64_exponent(uint64_t v) {
  using F64 = Float64Container;
  const uint64_t field = (v & F64::abs_mask) >> F64::man_bits;
  if (field != 0) return static_cast<int32_t>(field) - F64::bias;
  return leading_bit(v & F64::man_mask) - F64::man_bits - F64::bias + 1;
}

// The exponent an operand's value x (finite, nonzero, float64 bits) is aligned by: the exponent of
// its leading bit, or emin for a subnormal of the operands' format.
LPSIM_FN int32_t operand_exponent(uint64_t x, int32_t emin) {
  return max_of(float64_exponent(x), emin);
}

// The terms of one step: the nonzero finite products with their alignment exponents (the sums of
// their operands' exponents; the product itself may exceed 2^exponent by up to a factor 4), and
// whether an Inf or NaN product appeared.
struct TensorCoreGroup {
  uint64_t value[kMaxTensorCoreGroup];
  int32_t exponent[kMaxTensorCoreGroup];
  int count = 0;  // nonzero finite products
  bool nan = false, pos_inf = false, neg_inf = false;

  LPSIM_FN void clear() {
    count = 0;
    nan = pos_inf = neg_inf = false;
  }
  // Adds the exact product of two operands (float64 bits; ua and ub the operands themselves).
  LPSIM_FN void add(uint64_t product, uint64_t ua, uint64_t ub, int32_t operand_emin) {
    using F64 = Float64Container;
    const uint64_t mag = product & F64::abs_mask;
    if (mag == 0) return;  // zero products take no part in the alignment
    if (mag > F64::inf_bits) {
      nan = true;
    } else if (mag == F64::inf_bits) {
      ((product & F64::sign_mask) != 0 ? neg_inf : pos_inf) = true;
    } else {
      value[count] = product;
      exponent[count] = operand_exponent(ua, operand_emin) + operand_exponent(ub, operand_emin);
      ++count;
    }
  }
};

// v (finite float64 bits) truncated toward zero to a multiple of 2^q, as a signed count of 2^q.
// Callers guarantee |v| < 2^(q + 62).
LPSIM_FN int64_t truncated_count(uint64_t v, int32_t q) {
  using F64 = Float64Container;
  const uint64_t field = (v & F64::abs_mask) >> F64::man_bits;
  const uint64_t significand =
      (v & F64::man_mask) | (field != 0 ? uint64_t(1) << F64::man_bits : 0);
  // |v| = significand 2^e with e the weight of the significand's last bit.
  const int32_t e = static_cast<int32_t>(field != 0 ? field : 1) - F64::bias - F64::man_bits;
  const int32_t shift = e - q;
  uint64_t count;
  if (shift >= 0) {
    count = significand << shift;
  } else {
    count = -shift >= 64 ? 0 : significand >> -shift;
  }
  const int64_t magnitude = static_cast<int64_t>(count);
  return (v & F64::sign_mask) != 0 ? -magnitude : magnitude;
}

// The float64 bits of m 2^q (m < 2^53, m 2^q a normal float64 or zero).
LPSIM_FN uint64_t scaled_bits(uint64_t m, int32_t q) {
  using F64 = Float64Container;
  if (m == 0) return 0;
  const int lead = leading_bit(m);
  const uint64_t field = static_cast<uint64_t>(q + lead + F64::bias);
  return (field << F64::man_bits) | ((m << (F64::man_bits - lead)) & F64::man_mask);
}

// The exact sum ua + ub rounded onto g by a rule chosen at run time: the one place where the
// tensor core's normalisation, whose rule is not MacSum's, meets the compile-time rules.
LPSIM_FN_RULE_SWITCH uint64_t round_sum_by_rule(Rounding rule, uint64_t ua, uint64_t ub,
                                                const Grid<Float64Container>& g, uint32_t random,
                                                uint32_t mask) {
  using F64 = Float64Container;
  switch (rule) {
    case Rounding::nearest:
      return round_sum_to_grid<Rounding::nearest, F64>(ua, ub, g, random, mask);
    case Rounding::nearest_away:
      return round_sum_to_grid<Rounding::nearest_away, F64>(ua, ub, g, random, mask);
    case Rounding::nearest_zero:
      return round_sum_to_grid<Rounding::nearest_zero, F64>(ua, ub, g, random, mask);
    case Rounding::toward_zero:
      return round_sum_to_grid<Rounding::toward_zero, F64>(ua, ub, g, random, mask);
    case Rounding::away:
      return round_sum_to_grid<Rounding::away, F64>(ua, ub, g, random, mask);
    case Rounding::up:
      return round_sum_to_grid<Rounding::up, F64>(ua, ub, g, random, mask);
    case Rounding::down:
      return round_sum_to_grid<Rounding::down, F64>(ua, ub, g, random, mask);
    case Rounding::odd:
      return round_sum_to_grid<Rounding::odd, F64>(ua, ub, g, random, mask);
    case Rounding::stochastic:
      return round_sum_to_grid<Rounding::stochastic, F64>(ua, ub, g, random, mask);
    case Rounding::stochastic_equal:
    default:
      return round_sum_to_grid<Rounding::stochastic_equal, F64>(ua, ub, g, random, mask);
  }
}

// One step: the group's products and c (float64 bits, a value of g) into the next value of g.
// NaN if a product or c is NaN or +Inf and -Inf meet; else an Inf among them (rounded onto g);
// else +0 when no term is nonzero or the exact sum is 0; else the exact sum of the truncated
// terms rounded once by spec.normalise (random: its random word).
LPSIM_FN uint64_t tensor_core_step(const TensorCoreSpec& spec, const TensorCoreGroup& group,
                                   uint64_t c, const Grid<Float64Container>& g, uint32_t random,
                                   uint32_t mask) {
  using F64 = Float64Container;
  const uint64_t c_mag = c & F64::abs_mask;
  const bool nan = group.nan || c_mag > F64::inf_bits;
  const bool pos_inf = group.pos_inf || c == F64::inf_bits;
  const bool neg_inf = group.neg_inf || c == (F64::sign_mask | F64::inf_bits);
  if (nan || (pos_inf && neg_inf)) return F64::quiet_nan;
  if (pos_inf || neg_inf) {
    return round_sum_by_rule(spec.normalise,
                             pos_inf ? F64::inf_bits : F64::sign_mask | F64::inf_bits, 0, g, random,
                             mask);
  }
  const bool has_c = c_mag != 0;
  if (group.count == 0 && !has_c) return 0;
  int32_t top = spec.exponent_floor;
  if (has_c) top = max_of(top, operand_exponent(c, kAccumulatorEmin));
  for (int i = 0; i < group.count; ++i) top = max_of(top, group.exponent[i]);
  const int32_t q = top - spec.fraction_bits;  // the weight of the last bit kept
  int64_t sum = has_c ? truncated_count(c, q) : 0;
  for (int i = 0; i < group.count; ++i) sum += truncated_count(group.value[i], q);
  if (sum == 0) return 0;
  const uint64_t negative = sum < 0 ? F64::sign_mask : 0;
  const uint64_t m = static_cast<uint64_t>(sum < 0 ? -sum : sum);
  // m 2^q = hi + lo with hi the top 53 bits of m and lo the rest, each exact in float64.
  const int excess = max_of(leading_bit(m) - F64::man_bits, 0);
  const uint64_t low = m & ((uint64_t(1) << excess) - 1);
  const uint64_t hi = negative | scaled_bits(m >> excess, q + excess);
  const uint64_t lo = low != 0 ? negative | scaled_bits(low, q) : 0;
  return round_sum_by_rule(spec.normalise, hi, lo, g, random, mask);
}

// The step in float64 arithmetic, for loops that hold the operands as float64 values (the CPU's
// tensor-core loop, cpu/tensor_core_loop.cpp, which the tests compare with tensor_core_step bit for
// bit). With finite operands and c, each term's truncation truncated_count(v, q) is trunc(v 2^-q)
// computed in float64: v is an exact product (at most 48 significant bits) or c (at most 53), and
// scaling by the power of two 2^-q is exact, or leaves a value below 1 that truncates to 0 either
// way; |v 2^-q| < 2^(F + 2). The group's terms and c are integers below 2^(F + 2), so every partial
// sum of them, in any order, is exact in float64 when (group + 1) 2^(F + 2) <= 2^53.
LPSIM_FN bool tensor_core_sums_in_float64(const TensorCoreSpec& spec) {
  return spec.fraction_bits <= 51 &&
         (int64_t(spec.group) + 1) << (spec.fraction_bits + 2) <= int64_t(1) << 53;
}

// The weights of the last kept bit that the float64 step serves: 2^-q and the result sum 2^q are
// normal float64 values (|sum| < 2^53).
LPSIM_FN bool tensor_core_weight_in_float64(int32_t q) { return q >= -1000 && q <= 960; }

// The step's result from the exact sum of its truncated terms in float64 (an integer, |sum| <
// 2^53) and the weight 2^q of their last bit: tensor_core_step's ending, on the same words, for
// the deterministic normalisation N (spec.normalise).
template <Rounding N>
LPSIM_FN uint64_t tensor_core_result(double sum, int32_t q, const Grid<Float64Container>& g) {
  if (sum == 0) return 0;
  // Exact: a power-of-two scaling to a normal value.
  return round_sum_to_grid<N, Float64Container>(bits_of_real(sum * pow2_double(q)), 0, g, 0, 0);
}

}  // namespace lpsim
