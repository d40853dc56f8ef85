// Device-neutral descriptions of an op's operands that the CPU loops, the CUDA launchers and the
// torch glue all pass around: which container a float tensor is, which integer type a dyadic
// mantissa is, and where a stochastic rounding's random word comes from.
#pragma once

#include <cstdint>

namespace lpsim {

// The container (the torch dtype) of a float tensor; container.h has each one's bit layout.
enum class Dtype : int32_t { float32, float64, bfloat16, float16 };

// The storage of a dyadic tensor's mantissas.
enum class Integer : int32_t { int32, int64 };

// Where the random word of a stochastic rounding comes from. The integer codes are part of the
// update ops' schemas: lpsim/update.py uses the same.
enum class Randomness : int32_t {
  position = 0,  // Philox keyed by (seed, offset) and the element's row-major position
  value = 1,     // Philox keyed by (seed, offset) and the operands' values (philox.h: value_word)
};

}  // namespace lpsim
