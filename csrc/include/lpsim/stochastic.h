// The stochastic-rounding decision, the one definition that every core calls: the float and fixed
// grids of round.h and the integers of dyadic.h. The same (seed, offset, element) therefore gives
// the same decision everywhere in lpsim, on the CPU and on CUDA.
//
// The inputs are 32-bit fixed-point numbers: `frac32` = floor(frac * 2^32), where frac in [0, 1)
// is the discarded fraction of the quantum (the position of x between its two neighbours), and
// `random`, the element's 32-bit random word. rbits (1..32) says how many of their top bits decide:
// with t = floor(frac * 2^rbits) and U = random >> (32 - rbits), uniform on {0 .. 2^rbits - 1},
//
//   x rounds up  <=>  t + U >= 2^rbits,
//
// so P(up) = t / 2^rbits = floor(frac * 2^rbits) / 2^rbits: exactly frac whenever frac has at most
// rbits bits, and below it by less than 2^-rbits otherwise (as if x were first truncated to rbits
// bits below the quantum).
#pragma once

#include "config.h"

namespace lpsim {

// The mask of the top rbits bits of a 32-bit word (rbits in 1..32; 32 keeps every bit). Computed
// once per call, outside the loops.
LPSIM_FN uint32_t random_mask(int rbits) {
  return rbits >= 32 ? 0xFFFFFFFFu : ~(0xFFFFFFFFu >> rbits);
}

// Whether stochastic rounding goes up (see above); mask = random_mask(rbits).
//
// t + U >= 2^rbits is t > (2^rbits - 1) - U, and (2^rbits - 1) - U is the top rbits bits of
// ~random. In 32-bit fixed point, with the bits below the top rbits of the right side set to ones,
// the comparison of the masked fraction against it is that comparison of the top bits: one AND, one
// OR, one compare, no shift by a run-time count, which keeps the float loops vectorised.
LPSIM_FN bool stochastic_rounds_up(uint32_t frac32, uint32_t random, uint32_t mask) {
  return (frac32 & mask) > (~random | ~mask);
}

}  // namespace lpsim
