// CPU loop of the fused optimizer steps (optim_step_ops.cpp, configured by optim_step_config.h)
// over the step arithmetic of lpsim/optim_step.h and the rounding loop of cpu/quantize.h. Plain C++
// on raw pointers, like every loop file (loops.h). float32 tensors only.
#pragma once

#include <cstdint>

#include "optim_step_config.h"

namespace lpsim::cpu {

// torch's float32 square root of x[0, n) into y (see optim_step.h).
using SqrtSpan = void (*)(const float* x, float* y, int64_t n);

// The step of elements [begin, end) of one parameter: the gradient scaled and rounded (written
// back), the update computed from the accumulator or the parameter, the new states rounded and
// stored, the new accumulator rounded and stored, and the parameter set to the new weight (the
// accumulator's value) rounded into the weight format. `sqrt` is torch's float32 square root on
// the CPU (Adam; see optim_step.h).
void optim_step(const StepConfig& config, SqrtSpan sqrt, const StepTensors& t, int64_t begin,
                int64_t end);

}  // namespace lpsim::cpu
