// CPU loop of the fused optimizer steps (optim_step_ops.cpp) over the step arithmetic of
// lpsim/optim_step.h and the rounding loop of cpu/quantize.h. Plain C++ on raw pointers, like every
// loop file (loops.h). float32 tensors only.
#pragma once

#include <lpsim/grid_spec.h>
#include <lpsim/optim_step.h>

#include <cstdint>

namespace lpsim::cpu {

// What one category of tensors (gradients, optimizer states, accumulators, weights) is rounded
// into; inactive: not rounded.
struct Rounder {
  bool active;
  GridSpec grid;
  Rounding rounding;
  RandomSpec random;  // seed and rbits; each tensor has its own stream offset
};

enum class Algorithm : int32_t { sgd = 0, adam = 1 };

// torch's float32 square root of x[0, n) into y (see optim_step.h).
using SqrtSpan = void (*)(const float* x, float* y, int64_t n);

struct StepConfig {
  Algorithm algorithm;
  SgdScalars sgd;
  AdamScalars adam;
  bool scale_grad;   // grad_scaling != 1
  float grad_scale;  // float(grad_scaling)
  Rounder grad, state, acc, weight;
  SqrtSpan sqrt;
};

// One parameter's tensors (nullptr: absent) and per-parameter values.
struct StepTensors {
  float* param;
  float* grad;    // nullptr: no gradient this step; the weight and states are only rounded again
  float* state1;  // SGD's momentum buffer, Adam's exp_avg
  float* state2;  // Adam's exp_avg_sq
  float* acc;     // the accumulator the update applies to, or nullptr
  bool fresh;     // SGD: the momentum buffer is new (its old values are not read)
  float neg_step_size, bias2_sqrt;  // Adam
  uint64_t offset[5];               // random streams: grad, state1, state2, acc, weight
};

// The step of elements [begin, end) of one parameter: the gradient scaled and rounded (written
// back), the update computed from the accumulator or the parameter, the new states rounded and
// stored, the new accumulator rounded and stored, and the parameter set to the new weight (the
// accumulator's value) rounded into the weight format.
void optim_step(const StepConfig& config, const StepTensors& t, int64_t begin, int64_t end);

}  // namespace lpsim::cpu
