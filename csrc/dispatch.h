// Run-time to compile-time dispatch shared by the CPU and CUDA code: every loop or kernel is
// instantiated for one rounding rule and one container, and these helpers pick the instance.
// Host code only.
#pragma once

#include <lpsim/container.h>
#include <lpsim/rounding.h>
#include <lpsim/types.h>

#include <type_traits>

namespace lpsim {

template <Rounding R>
using RoundingTag = std::integral_constant<Rounding, R>;

// f(RoundingTag<R>{}) for the run-time rule r.
template <class F>
LPSIM_INLINE void with_rounding(Rounding r, F&& f) {
  switch (r) {
    case Rounding::nearest:
      return f(RoundingTag<Rounding::nearest>{});
    case Rounding::nearest_away:
      return f(RoundingTag<Rounding::nearest_away>{});
    case Rounding::nearest_zero:
      return f(RoundingTag<Rounding::nearest_zero>{});
    case Rounding::toward_zero:
      return f(RoundingTag<Rounding::toward_zero>{});
    case Rounding::away:
      return f(RoundingTag<Rounding::away>{});
    case Rounding::up:
      return f(RoundingTag<Rounding::up>{});
    case Rounding::down:
      return f(RoundingTag<Rounding::down>{});
    case Rounding::odd:
      return f(RoundingTag<Rounding::odd>{});
    case Rounding::stochastic:
      return f(RoundingTag<Rounding::stochastic>{});
    case Rounding::stochastic_equal:
      return f(RoundingTag<Rounding::stochastic_equal>{});
  }
}

// f(std::bool_constant<b>{}) for the run-time flag b: a loop instantiated for each value, so that
// its branches on the flag fold away and it vectorises.
template <class F>
LPSIM_INLINE void with_flag(bool b, F&& f) {
  if (b) return f(std::true_type{});
  return f(std::false_type{});
}

// f(C{}) for the container C of the run-time dtype.
template <class F>
LPSIM_INLINE void with_container(Dtype d, F&& f) {
  switch (d) {
    case Dtype::float32:
      return f(Float32Container{});
    case Dtype::float64:
      return f(Float64Container{});
    case Dtype::bfloat16:
      return f(BFloat16Container{});
    case Dtype::float16:
      return f(Float16Container{});
  }
}

// f(B{}) for the container B of an operand of an update of an A tensor: A's, float32 or float64
// (the dtypes operand_of in checks.cpp lets through).
template <class A, class F>
LPSIM_INLINE void with_operand(Dtype b, F&& f) {
  if (b == Dtype::float32) return f(Float32Container{});
  if (b == Dtype::float64) return f(Float64Container{});
  return f(A{});
}

}  // namespace lpsim
