// Helpers shared by the stochastic-arithmetic loops (arith_update.cpp, arith_accumulate.cpp):
// dispatch on the run-time container and rule, and position-keyed words for any index sequence.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include <lpsim/container.h>
#include <lpsim/philox.h>

#include "kernels.h"

// Lambdas that must be inlined into their caller, so that they are compiled for the caller's
// target when the caller is multiversioned (as in kernels.cpp).
#define LPSIM_LAMBDA_INLINE __attribute__((always_inline))

namespace lpsim::cpu::arith {

template <Rounding R>
using RuleTag = std::integral_constant<Rounding, R>;

// Call f(RuleTag<R>{}) for the run-time rule r: one instantiation per rule, every rule of the
// enum (its codes are 0 .. kNumRoundings - 1).
template <class F, size_t... kCodes>
LPSIM_INLINE void with_rule_of(Rounding r, F&& f, std::index_sequence<kCodes...>) {
  (void)((static_cast<size_t>(r) == kCodes ? (f(RuleTag<static_cast<Rounding>(kCodes)>{}), true)
                                           : false) ||
         ...);
}

template <class F>
LPSIM_INLINE void with_rule(Rounding r, F&& f) {
  with_rule_of(r, f, std::make_index_sequence<kNumRoundings>{});
}

// Call f(C{}) for the container of the run-time dtype.
template <class F>
LPSIM_INLINE void with_dtype(Dtype d, F&& f) {
  switch (d) {
    case Dtype::float32: return f(Float32Container{});
    case Dtype::float64: return f(Float64Container{});
    case Dtype::bfloat16: return f(BFloat16Container{});
    case Dtype::float16: return f(Float16Container{});
  }
}

template <class C>
LPSIM_INLINE typename C::word bits_of(const typename C::storage& s) {
  return static_cast<typename C::word>(s);
}

// The position-keyed words of lpsim/philox.h for any sequence of indices; the words of one group
// of kGroupSize indices are generated together and kept while the indices stay in the group.
class PositionWords {
 public:
  explicit PositionWords(const RandomSpec& r) : key_(make_philox_key(r.seed, r.offset)) {}

  uint32_t operator()(uint64_t index) { return group(index / kGroupSize)[index % kGroupSize]; }

  // The kGroupSize words of group g.
  const uint32_t* group(uint64_t g) {
    if (static_cast<int64_t>(g) != group_) {
      philox_group(g, key_, words_);
      group_ = static_cast<int64_t>(g);
    }
    return words_;
  }

 private:
  PhiloxKey key_;
  int64_t group_ = -1;
  alignas(64) uint32_t words_[kGroupSize];
};

}  // namespace lpsim::cpu::arith
