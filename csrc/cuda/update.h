// CUDA launchers of the update ops (sr_add, sr_addc): plain C++ on raw device pointers, like
// cpu/update.h. Each handles the n > 0 elements of contiguous arrays on the current device and
// enqueues one kernel on `stream`. The results are bit-identical to the CPU loops' for the same
// seed and offset: both load the operands with lpsim/update.h and call the core's
// round_sum_to_grid on the same words.
#pragma once

#include <cuda_runtime_api.h>
#include <lpsim/grid_spec.h>
#include <lpsim/rounding.h>
#include <lpsim/types.h>

#include <cstdint>

namespace lpsim::gpu {

// y = x + b, as cpu::add_rounded over [0, n).
void add_rounded(Dtype a, Dtype b, Rounding rounding, Randomness randomness, const void* x,
                 const void* bv, void* y, int64_t n, const GridSpec& grid, const RandomSpec& random,
                 cudaStream_t stream);

// y = x + (value * t1) op t2, as cpu::addc_rounded over [0, n).
void addc_rounded(Dtype a, Dtype t, bool divide, double value, Rounding rounding,
                  Randomness randomness, const void* x, const void* t1, const void* t2, void* y,
                  int64_t n, const GridSpec& grid, const RandomSpec& random, cudaStream_t stream);

}  // namespace lpsim::gpu
