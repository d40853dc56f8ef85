// The container-independent description of a grid that the Python layer passes to the ops, and its
// conversion into a Grid for a given container (host code, shared by the CPU and CUDA ops).
#pragma once

#include <cmath>
#include <cstring>

#include "round.h"

namespace lpsim {

// The fields of a grid, declared once. LPSIM_GRID_FIELDS(X, P) calls X(P, type, name) for each
// field, in the order of the ops' schemas, and everything else is generated from it: the GridSpec
// struct below, the schema text and the C++ parameter lists of every op that takes a grid
// (csrc/checks.h), and the struct initialiser in those ops. P is a prefix for the argument names
// (dot_rounded's `mul_` grid). The types are those of the op arguments (int -> int64_t, float ->
// double, bool -> bool). Python's side is the GridSpec NamedTuple of lpsim/formats.py, whose fields
// tests/test_one_stochastic_decision.py checks against the registered schemas; a new field is added
// there and here, and used in make_grid below.
//
// Exponents are unbiased; limits are real values (+Inf: unbounded). lpsim/formats.py builds these.
//   keep              fraction bits kept in the normal range; < 0: the container's precision
//   qmin              exponent of the finest spacing
//   emin              exponent of the smallest normal (used only without subnormals)
//   subnormals        whether the format has subnormals (else values below 2^emin flush)
//   pos_limit         largest positive value
//   neg_limit         largest magnitude of a negative value (0 in unsigned formats)
//   saturate          overflow clamps to the limit (else Inf, or NaN where there is no Inf)
//   has_inf           the format has +Inf, and -Inf where it has negative values (neg_limit > 0):
//                     +/-Inf inputs stay infinite and an overflow that does not saturate becomes
//                     +/-Inf; otherwise both become the limit (saturate) or NaN. A format without
//                     negative values (unsigned P3109) has no -Inf.
//   unsigned_zero     the format has no -0
//   code_parity       ties to even and rounding to odd look at the parity of the value's code, not
//                     of its significand; the two differ only where the leading one is the only
//                     kept bit (precision 1), where every significand is odd: IEEE 754 then gives a
//                     tie to the larger magnitude, P3109 to the even exponent code
#define LPSIM_GRID_FIELDS(X, P) \
  X(P, int64_t, keep)           \
  X(P, int64_t, qmin)           \
  X(P, int64_t, emin)           \
  X(P, bool, subnormals)        \
  X(P, double, pos_limit)       \
  X(P, double, neg_limit)       \
  X(P, bool, saturate)          \
  X(P, bool, has_inf)           \
  X(P, bool, unsigned_zero)     \
  X(P, bool, code_parity)

struct GridSpec {
#define LPSIM_GRID_DECLARE_(P, type, name) type name;
  LPSIM_GRID_FIELDS(LPSIM_GRID_DECLARE_, )
#undef LPSIM_GRID_DECLARE_
};

struct RandomSpec {
  uint64_t seed;
  uint64_t offset;
  int32_t rbits;  // 1..32
};

// Container bits of a non-negative value that the container holds exactly; false otherwise.
template <class C>
bool exact_bits(double v, typename C::word& out) {
  using W = typename C::word;
  if (!(v >= 0)) return false;
  if (std::isinf(v)) {
    out = C::inf_bits;
    return true;
  }
  if (v == 0) {
    out = 0;
    return true;
  }
  int e;
  std::frexp(v, &e);  // v = m * 2^e, 0.5 <= m < 1
  const int eb = e - 1 + C::bias;
  if (eb >= (1 << C::exp_bits) - 1) return false;
  // Scale so that the container's quantum at v is 1; the scaled value must be an integer.
  const int quantum_exp = (eb >= 1 ? eb : 1) - C::bias - C::man_bits;
  const double scaled = std::ldexp(v, -quantum_exp);
  if (scaled != std::floor(scaled)) return false;
  const W sig = static_cast<W>(scaled);
  out = eb >= 1 ? (W(eb) << C::man_bits) | (sig & C::man_mask) : sig;
  return true;
}

// The Grid for container C, or nullptr and a message when the spec does not fit the container.
template <class C>
const char* make_grid(const GridSpec& s, Grid<C>& g) {
  using W = typename C::word;
  // The exponents were checked to lie well inside int32 (grid_spec in csrc/checks.cpp).
  g.keep = s.keep < 0 || s.keep > C::man_bits ? C::man_bits : static_cast<int32_t>(s.keep);
  g.qmin = static_cast<int32_t>(s.qmin) + C::bias;
  g.flush_below = s.subnormals ? kNoFlush : static_cast<int32_t>(s.emin) + C::bias;
  g.zero_sign = s.unsigned_zero ? 0 : C::sign_mask;
  const int32_t smallest = s.subnormals ? g.qmin : g.flush_below;
  if (smallest < 1 - C::man_bits || smallest >= (1 << C::exp_bits) - 1) {
    return "the format's smallest spacing is not representable in this container";
  }
  g.min_positive = pow2_bits<C>(smallest);
  if (!exact_bits<C>(s.pos_limit, g.pos_limit) || !exact_bits<C>(s.neg_limit, g.neg_limit)) {
    return "the format's largest values are not representable in this container";
  }
  // Unclamped overflow: Inf where the side has it, else NaN. Without negative values (neg_limit =
  // 0, unsigned formats) there is no -Inf.
  const bool neg_inf = s.has_inf && s.neg_limit > 0;
  const W pos_unbounded = s.has_inf ? C::inf_bits : C::quiet_nan;
  const W neg_unbounded = neg_inf ? C::inf_bits : C::quiet_nan;
  g.pos_overflow = s.saturate ? g.pos_limit : pos_unbounded;
  g.neg_overflow = s.saturate ? g.neg_limit : neg_unbounded;
  g.pos_inf = s.has_inf ? C::inf_bits : g.pos_overflow;
  g.neg_inf = neg_inf ? C::inf_bits : g.neg_overflow;
  g.code_parity = s.code_parity ? 0x80000000u : 0u;
  return nullptr;
}

}  // namespace lpsim
