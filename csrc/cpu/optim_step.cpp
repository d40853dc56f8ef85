// CPU loop of the fused optimizer steps (see optim_step.h), cloned for FMA (loops.h).
#include "cpu/optim_step.h"

#include <algorithm>

#include "cpu/loops.h"
#include "cpu/quantize.h"

namespace lpsim::cpu {

namespace {

// Elements computed together: whole random-word groups, so that each rounding of a chunk generates
// each of its groups once; 8 groups, so that the per-call cost of each rounding is spread over 2048
// elements while the chunk's buffers (8 KiB each) stay in the L1 cache.
constexpr int64_t kChunk = 8 * kGroupSize;

// y[0, n) = x[0, n) rounded by r, the elements [first, first + n) of a tensor whose random stream
// is `offset`; an inactive r copies.
void round_into(const Rounder& r, uint64_t offset, const float* x, float* y, int64_t first,
                int64_t n) {
  if (!r.active) {
    if (x != y) std::copy(x, x + n, y);
    return;
  }
  RandomSpec random = r.random;
  random.offset = offset;
  quantize_grid_span(Dtype::float32, r.rounding, x, y, first, n, r.grid, random);
}

}  // namespace

LPSIM_MULTIVERSION_FMA
void optim_step(const StepConfig& c, const StepTensors& t, int64_t begin, int64_t end) {
  float w[kChunk], s1[kChunk], s2[kChunk], root[kChunk];
  const bool adam = c.algorithm == Algorithm::adam;
  for (int64_t first = begin; first < end; first += kChunk) {
    const int64_t n = std::min(kChunk, end - first);
    // The weight the update applies to: the accumulator, else the parameter.
    const float* w0 = (t.acc != nullptr ? t.acc : t.param) + first;
    std::copy(w0, w0 + n, w);
    if (t.state1 != nullptr) std::copy(t.state1 + first, t.state1 + first + n, s1);
    if (t.state2 != nullptr) std::copy(t.state2 + first, t.state2 + first + n, s2);
    if (t.grad != nullptr) {
      float* g = t.grad + first;
      if (c.scale_grad) {
        for (int64_t k = 0; k < n; ++k) g[k] = mul_rn(g[k], c.grad_scale);  // grad.mul_(scaling)
      }
      round_into(c.grad, t.offset[0], g, g, first, n);
      if (!adam) {
        for (int64_t k = 0; k < n; ++k) w[k] = sgd_element(w[k], g[k], s1[k], t.fresh, c.sgd);
      } else {
        for (int64_t k = 0; k < n; ++k) w[k] = adam_moments(w[k], g[k], s1[k], s2[k], c.adam);
        c.sqrt(s2, root, n);
        for (int64_t k = 0; k < n; ++k) {
          w[k] = adam_update(w[k], s1[k], root[k], t.bias2_sqrt, t.neg_step_size, c.adam);
        }
      }
    }
    if (t.state1 != nullptr) round_into(c.state, t.offset[1], s1, t.state1 + first, first, n);
    if (t.state2 != nullptr) round_into(c.state, t.offset[2], s2, t.state2 + first, first, n);
    if (t.acc != nullptr) {
      round_into(c.acc, t.offset[3], w, t.acc + first, first, n);
      round_into(c.weight, t.offset[4], t.acc + first, t.param + first, first, n);
    } else {
      round_into(c.weight, t.offset[4], w, t.param + first, first, n);
    }
  }
}

}  // namespace lpsim::cpu
