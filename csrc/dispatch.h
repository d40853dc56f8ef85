// Run-time to compile-time dispatch shared by the CPU and CUDA code: every loop or kernel is
// instantiated for one rounding rule and one container, and these helpers pick the instance.
// Host code only.
#pragma once

#include <type_traits>

#include <lpsim/container.h>
#include <lpsim/rounding.h>

#include "cpu/kernels.h"

namespace lpsim {

template <Rounding R>
using RoundingTag = std::integral_constant<Rounding, R>;

// f(RoundingTag<R>{}) for the run-time rule r.
template <class F>
LPSIM_INLINE void with_rounding(Rounding r, F&& f) {
  switch (r) {
    case Rounding::nearest: return f(RoundingTag<Rounding::nearest>{});
    case Rounding::nearest_away: return f(RoundingTag<Rounding::nearest_away>{});
    case Rounding::nearest_zero: return f(RoundingTag<Rounding::nearest_zero>{});
    case Rounding::toward_zero: return f(RoundingTag<Rounding::toward_zero>{});
    case Rounding::away: return f(RoundingTag<Rounding::away>{});
    case Rounding::up: return f(RoundingTag<Rounding::up>{});
    case Rounding::down: return f(RoundingTag<Rounding::down>{});
    case Rounding::odd: return f(RoundingTag<Rounding::odd>{});
    case Rounding::stochastic: return f(RoundingTag<Rounding::stochastic>{});
    case Rounding::stochastic_equal: return f(RoundingTag<Rounding::stochastic_equal>{});
  }
}

// f(C{}) for the container C of the run-time dtype.
template <class F>
LPSIM_INLINE void with_container(cpu::Dtype d, F&& f) {
  switch (d) {
    case cpu::Dtype::float32: return f(Float32Container{});
    case cpu::Dtype::float64: return f(Float64Container{});
    case cpu::Dtype::bfloat16: return f(BFloat16Container{});
    case cpu::Dtype::float16: return f(Float16Container{});
  }
}

}  // namespace lpsim
