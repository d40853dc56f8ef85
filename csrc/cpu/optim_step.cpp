// CPU loop of the fused optimizer steps (see optim_step.h), cloned for FMA (loops.h).
#include "cpu/optim_step.h"

#include <algorithm>

#include "cpu/loops.h"
#include "cpu/quantize.h"
#include "dispatch.h"

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

// w[k] = the new weight from the weight w0[k] and gradient g[k], s1[k] = the new momentum buffer
// from the old m0[k] (sgd_element), k in [0, n). The flags are made constants of each instance, so
// that sgd_element's branches fold and the loop vectorises.
LPSIM_INLINE void sgd_span(const SgdScalars& scalars, bool fresh, const float* __restrict w0,
                           const float* __restrict g, const float* __restrict m0,
                           float* __restrict w, float* __restrict s1, int64_t n) {
  with_flag(scalars.has_weight_decay, [&](auto decay) LPSIM_LAMBDA_INLINE {
    with_flag(scalars.has_momentum, [&](auto momentum) LPSIM_LAMBDA_INLINE {
      with_flag(scalars.nesterov, [&](auto nesterov) LPSIM_LAMBDA_INLINE {
        with_flag(scalars.maximize, [&](auto maximize) LPSIM_LAMBDA_INLINE {
          with_flag(fresh, [&](auto fresh_buffer) LPSIM_LAMBDA_INLINE {
            SgdScalars s = scalars;
            s.has_weight_decay = decay;
            s.has_momentum = momentum;
            s.nesterov = nesterov;
            s.maximize = maximize;
            for (int64_t k = 0; k < n; ++k) {
              float buf = m0[k];
              w[k] = sgd_element(w0[k], g[k], buf, fresh_buffer, s);
              s1[k] = buf;
            }
          });
        });
      });
    });
  });
}

// w[k] = the weight the update applies to, s1[k] and s2[k] the new moments from the old m0[k] and
// v0[k] (adam_moments), k in [0, n); the flags constants of each instance, as in sgd_span.
LPSIM_INLINE void adam_moments_span(const AdamScalars& scalars, const float* __restrict w0,
                                    const float* __restrict g, const float* __restrict m0,
                                    const float* __restrict v0, float* __restrict w,
                                    float* __restrict s1, float* __restrict s2, int64_t n) {
  with_flag(scalars.coupled_decay, [&](auto coupled) LPSIM_LAMBDA_INLINE {
    with_flag(scalars.decoupled_decay, [&](auto decoupled) LPSIM_LAMBDA_INLINE {
      with_flag(scalars.maximize, [&](auto maximize) LPSIM_LAMBDA_INLINE {
        AdamScalars s = scalars;
        s.coupled_decay = coupled;
        s.decoupled_decay = decoupled;
        s.maximize = maximize;
        for (int64_t k = 0; k < n; ++k) {
          float m = m0[k], v = v0[k];
          w[k] = adam_moments(w0[k], g[k], m, v, s);
          s1[k] = m;
          s2[k] = v;
        }
      });
    });
  });
}

}  // namespace

LPSIM_MULTIVERSION_FMA
void optim_step(const StepConfig& c, SqrtSpan sqrt, const StepTensors& t, int64_t begin,
                int64_t end) {
  // The update loops read an absent state as zeros (and do not use its value): their branches are
  // selects, so that they vectorise.
  float w[kChunk], s1[kChunk], s2[kChunk], root[kChunk], zeros[kChunk] = {};
  // Local copies: the loops then read no field through a reference, which would otherwise be
  // reloaded in every iteration (and keep them scalar).
  const SgdScalars sgd = c.sgd;
  const AdamScalars adam_scalars = c.adam;
  const bool adam = c.algorithm == Algorithm::adam, fresh = t.fresh;
  const float grad_scale = c.grad_scale;
  const float bias2_sqrt = t.bias2_sqrt, neg_step_size = t.neg_step_size;
  for (int64_t first = begin; first < end; first += kChunk) {
    const int64_t n = std::min(kChunk, end - first);
    // The weight the update applies to: the accumulator, else the parameter; and the states, read
    // from memory by the update loops (or copied, without a gradient).
    const float* w0 = (t.acc != nullptr ? t.acc : t.param) + first;
    const float* m0 = t.state1 != nullptr ? t.state1 + first : zeros;
    const float* v0 = t.state2 != nullptr ? t.state2 + first : zeros;
    if (t.grad == nullptr) {
      std::copy(w0, w0 + n, w);
      if (t.state1 != nullptr) std::copy(m0, m0 + n, s1);
      if (t.state2 != nullptr) std::copy(v0, v0 + n, s2);
    } else {
      float* g = t.grad + first;
      if (c.scale_grad) {
        for (int64_t k = 0; k < n; ++k) g[k] = mul_rn(g[k], grad_scale);  // grad.mul_(scaling)
      }
      round_into(c.grad, t.offset[0], g, g, first, n);
      if (!adam) {
        sgd_span(sgd, fresh, w0, g, m0, w, s1, n);
      } else {
        adam_moments_span(adam_scalars, w0, g, m0, v0, w, s1, s2, n);
        sqrt(s2, root, n);
        for (int64_t k = 0; k < n; ++k) {
          w[k] = adam_update(w[k], s1[k], root[k], bias2_sqrt, neg_step_size, adam_scalars);
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
