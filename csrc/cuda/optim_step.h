// CUDA launcher of the fused optimizer step op (optim_step_ops.cpp). Plain C++ on raw device
// pointers, like quantize.h; the kernel is in optim_step.cu, over the core's step arithmetic
// (lpsim/optim_step.h) and rounding (lpsim/round.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "optim_step_config.h"

namespace lpsim::gpu {

// The step of the `count` parameters tensors[j] (numels[j] elements each, contiguous float32 on
// the current device), as the CPU loop (cpu/optim_step.h) computes it element by element, with the
// same random words, in the arithmetic of torch's CUDA kernels: Adam's last addition and square
// root differ from the CPU's (lpsim/optim_step.h), SGD's do not.
void optim_step(const StepConfig& config, const StepTensors* tensors, const int64_t* numels,
                int64_t count, cudaStream_t stream);

}  // namespace lpsim::gpu
