// The configuration of one fused optimizer step (optim_step_ops.cpp), shared by its CPU loop
// (cpu/optim_step.h) and its CUDA kernel (cuda/optim_step.h): the algorithm and its scalars, the
// four rounding categories, and each parameter's tensors. Plain C++, no torch.
#pragma once

#include <lpsim/grid_spec.h>
#include <lpsim/optim_step.h>

#include <cstdint>

namespace lpsim {

// What one category of tensors (gradients, optimizer states, accumulators, weights) is rounded
// into; inactive: not rounded.
struct Rounder {
  bool active;
  GridSpec grid;
  Rounding rounding;
  RandomSpec random;  // seed and rbits; each tensor has its own stream offset
};

enum class Algorithm : int32_t { sgd = 0, adam = 1 };

struct StepConfig {
  Algorithm algorithm;
  SgdScalars sgd;
  AdamScalars adam;
  bool scale_grad;   // grad_scaling != 1
  float grad_scale;  // float(grad_scaling)
  Rounder grad, state, acc, weight;
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

}  // namespace lpsim
