// The rounding rules. The integer codes are part of the op schema: lpsim/rounding.py uses the same.
#pragma once

#include "config.h"

namespace lpsim {

enum class Rounding : int32_t {
  nearest = 0,           // to the nearest value, ties to the even neighbour
  nearest_away = 1,      // to the nearest value, ties away from zero
  nearest_zero = 2,      // to the nearest value, ties toward zero
  toward_zero = 3,       // truncation
  away = 4,              // away from zero
  up = 5,                // toward +Inf
  down = 6,              // toward -Inf
  odd = 7,               // inexact values go to the neighbour with an odd last digit
  stochastic = 8,        // up with probability proportional to the distance from below ("mode 1")
  stochastic_equal = 9,  // inexact values go up or down with probability 1/2 ("mode 2")
};

constexpr int kNumRoundings = 10;

constexpr bool is_stochastic(Rounding r) {
  return r == Rounding::stochastic || r == Rounding::stochastic_equal;
}

}  // namespace lpsim
