// Helpers shared by the stochastic-arithmetic loops (arith_update.cpp, arith_accumulate.cpp): the
// run-time dispatch of dispatch.h, and position-keyed words for any sequence of indices.
#pragma once

#include <cstdint>

#include <lpsim/container.h>
#include <lpsim/philox.h>

#include "dispatch.h"
#include "kernels.h"

// Lambdas that must be inlined into their caller, so that they are compiled for the caller's
// target when the caller is multiversioned (as in kernels.cpp).
#define LPSIM_LAMBDA_INLINE __attribute__((always_inline))

namespace lpsim::cpu::arith {

using lpsim::with_container;
using lpsim::with_rounding;

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
