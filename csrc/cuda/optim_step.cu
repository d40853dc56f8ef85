// CUDA kernel of the fused optimizer step (see optim_step.h): one launch per kStepTensors
// parameters, a thread per Philox counter of each parameter, as in quantize.cuh's round_item:
// counter c gives the words of the four elements philox_element_of(c, w), so each rounding
// category draws one Philox call per four elements, and for each w a warp reads and writes 32
// consecutive elements. Each element goes through the CPU loop's sequence (cpu/optim_step.cpp):
// the gradient scaled, rounded and written back; the core's SGD or Adam arithmetic; the new states
// rounded; the accumulator rounded, then the weight from it. The kernel holds no arithmetic or
// rounding of its own.
#include <lpsim/ieee_ops.h>
#include <lpsim/optim_step.h>
#include <lpsim/philox.h>
#include <lpsim/round.h>

#include "cuda/device.cuh"
#include "cuda/optim_step.h"

namespace lpsim::gpu {
namespace {

using F32 = Float32Container;

// Parameters per launch: their descriptors travel as kernel arguments (below CUDA's 4 KiB).
constexpr int kStepTensors = 24;

// One category's rounding (Rounder) in the form the kernel reads.
struct DeviceRounder {
  Grid<F32> grid;
  Rounding rule;
  bool active;  // false: not rounded
  bool stochastic;
  uint64_t seed;
  uint32_t mask;
};

DeviceRounder device_rounder(const Rounder& r) {
  DeviceRounder d{};
  d.active = r.active;
  if (!r.active) return d;
  make_grid<F32>(r.grid, d.grid);
  d.rule = r.rounding;
  d.stochastic = is_stochastic(r.rounding);
  d.seed = r.random.seed;
  d.mask = random_mask(r.random.rbits);
  return d;
}

struct DeviceStep {
  Algorithm algorithm;
  SgdScalars sgd;
  AdamScalars adam;
  bool scale_grad;
  float grad_scale;
  DeviceRounder grad, state, acc, weight;
};

// The parameters of one launch: parameter t owns the counters [items_before[t], items_before[t +
// 1]) of the launch.
struct StepLaunch {
  StepTensors tensors[kStepTensors];
  uint64_t numel[kStepTensors];
  uint64_t items_before[kStepTensors + 1];
  int count;
};

static_assert(sizeof(StepLaunch) + sizeof(DeviceStep) < 4000, "kernel arguments above 4 KiB");

// The words of counter c in the stream `offset` of r's seed (zeros where r draws none).
__device__ __forceinline__ PhiloxWords words_of(const DeviceRounder& r, uint64_t offset,
                                                uint64_t c) {
  if (!r.active || !r.stochastic) return PhiloxWords{};
  return philox_counter_words(c, make_philox_key(r.seed, offset));
}

// x rounded by r (unchanged where r is inactive).
__device__ __forceinline__ float rounded(const DeviceRounder& r, float x, uint32_t word) {
  if (!r.active) return x;
  return real_of(round_to_grid_by_rule<F32>(r.rule, bits_of_real(x), r.grid, word, r.mask));
}

__global__ void __launch_bounds__(kThreads) step_kernel(StepLaunch launch, DeviceStep step) {
  const uint64_t first = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  const uint64_t items = launch.items_before[launch.count];
  for (uint64_t item = first; item < items; item += stride) {
    const int j = tensor_of_item(launch.items_before, launch.count, item);
    const StepTensors& t = launch.tensors[j];
    const uint64_t n = launch.numel[j], c = item - launch.items_before[j];
    const PhiloxWords grad_words = words_of(step.grad, t.offset[0], c);
    const PhiloxWords state1_words = words_of(step.state, t.offset[1], c);
    const PhiloxWords state2_words = words_of(step.state, t.offset[2], c);
    const PhiloxWords acc_words = words_of(step.acc, t.offset[3], c);
    const PhiloxWords weight_words = words_of(step.weight, t.offset[4], c);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint64_t i = philox_element_of(c, w);
      if (i >= n) continue;
      // The weight the update applies to (the accumulator, else the parameter) and the states.
      float weight = t.acc != nullptr ? t.acc[i] : t.param[i];
      float s1 = t.state1 != nullptr ? t.state1[i] : 0.0f;
      float s2 = t.state2 != nullptr ? t.state2[i] : 0.0f;
      if (t.grad != nullptr) {
        float g = t.grad[i];
        if (step.scale_grad) g = mul_rn(g, step.grad_scale);  // grad.mul_(scaling)
        g = rounded(step.grad, g, grad_words.w[w]);
        if (step.scale_grad || step.grad.active) t.grad[i] = g;
        if (step.algorithm == Algorithm::sgd) {
          weight = sgd_element(weight, g, s1, t.fresh, step.sgd);
        } else {
          weight = adam_moments(weight, g, s1, s2, step.adam);
          weight = adam_update(weight, s1, sqrt_rn(s2), t.bias2_sqrt, t.neg_step_size, step.adam);
        }
      }
      if (t.state1 != nullptr) t.state1[i] = rounded(step.state, s1, state1_words.w[w]);
      if (t.state2 != nullptr) t.state2[i] = rounded(step.state, s2, state2_words.w[w]);
      if (t.acc != nullptr) {
        weight = rounded(step.acc, weight, acc_words.w[w]);
        t.acc[i] = weight;
      }
      t.param[i] = rounded(step.weight, weight, weight_words.w[w]);
    }
  }
}

}  // namespace

void optim_step(const StepConfig& config, const StepTensors* tensors, const int64_t* numels,
                int64_t count, cudaStream_t stream) {
  const DeviceStep step{config.algorithm,
                        config.sgd,
                        config.adam,
                        config.scale_grad,
                        config.grad_scale,
                        device_rounder(config.grad),
                        device_rounder(config.state),
                        device_rounder(config.acc),
                        device_rounder(config.weight)};
  for (int64_t begin = 0; begin < count; begin += kStepTensors) {
    StepLaunch launch{};
    uint64_t items = 0;
    for (int64_t j = begin; j < count && j < begin + kStepTensors; ++j) {
      if (numels[j] == 0) continue;
      launch.tensors[launch.count] = tensors[j];
      launch.numel[launch.count] = static_cast<uint64_t>(numels[j]);
      launch.items_before[launch.count] = items;
      items += philox_counters_for(static_cast<uint64_t>(numels[j]));
      ++launch.count;
    }
    launch.items_before[launch.count] = items;
    if (items == 0) continue;
    step_kernel<<<blocks_for(items), kThreads, 0, stream>>>(launch, step);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace lpsim::gpu
