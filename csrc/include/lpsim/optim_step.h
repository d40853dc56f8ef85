// The arithmetic of one element of an optimizer step, as torch.optim's single-tensor SGD and
// Adam/AdamW compute it in float32 (foreach=False), operation by operation, so that a fused step
// reproduces torch's bits. Established against torch 2.14's CPU kernels on random data with mixed
// magnitudes (tests/test_fused_optim.py keeps checking it):
//
//   x.add(y, alpha=a), x.add_(y, alpha=a)  fma(y, float(a), x)  (ATen's vectorised add is an fma;
//                                          its scalar tail is contracted to the same fma)
//   x.mul_(s)                              x * float(s)
//   x.lerp_(y, w)                          |w| < 0.5: fma(w, y - x, x); else fma(w - 1, y - x, y)
//                                          (w = float(w), ATen's two-branch lerp)
//   x.addcmul_(y, z, value=c)              fma(float(c) * y, z, x)
//   x.addcdiv_(y, z, value=c)              x + (float(c) * y) / z
//   x.sqrt()                               torch's own sqrt: MKL's vsSqrt where torch uses it,
//                                          which is not always correctly rounded, so the caller
//                                          computes it (adam_update takes its result)
//   x / s, x.add_(s)                       x / float(s), x + float(s)
//
// On CUDA devices ATen's kernels are the same expressions compiled by nvcc, which contracts a
// product followed by an addition into an fma: the forms above, except for
//   x.addcmul_(y, z, value=c)              fma(float(c), y * z, x)  (a + alpha * (b * c))
//   x.addcdiv_(y, z, value=c)              fma(float(c), y / z, x)  (a + alpha * (b / c))
//   x / s                                  x * (1 / float(s))  (a CPU scalar divisor: ATen
//                                          multiplies by its reciprocal)
//   x.sqrt()                               correctly rounded (sqrt_rn)
// tests/test_fused_optim_cuda.py checks the device forms against torch's CUDA optimizers on a GPU.
//
// Python scalars (lr, betas, bias corrections) are computed in double by the caller, as torch's
// Python code computes them, and converted to float32 once, as ATen converts a Scalar.
//
// Every operation is rounded once: the host code is compiled with -ffp-contract=off, and device
// code uses the _rn intrinsics, which nvcc never contracts.
#pragma once

#include <cmath>

#include "config.h"
#include "ieee_ops.h"

namespace lpsim {

// ---- SGD (torch.optim.SGD, _single_tensor_sgd)

struct SgdScalars {
  float weight_decay;         // float(weight_decay)
  float momentum;             // float(momentum)
  float one_minus_dampening;  // float(1 - dampening)
  float neg_lr;               // float(-lr)
  bool has_weight_decay;      // weight_decay != 0
  bool has_momentum;          // momentum != 0
  bool nesterov;
  bool maximize;
};

// The new weight from the weight w and the gradient g. With momentum, `buf` is the momentum
// buffer, replaced by its new value; `fresh`: the buffer does not exist yet (torch's first step
// takes the direction itself).
LPSIM_FN float sgd_element(float w, float g, float& buf, bool fresh, const SgdScalars& s) {
  float d = s.maximize ? neg(g) : g;                         // grad = -grad (torch.neg)
  if (s.has_weight_decay) d = fma_rn(w, s.weight_decay, d);  // grad.add(param, alpha=weight_decay)
  if (s.has_momentum) {
    // buf.mul_(momentum).add_(grad, alpha=1 - dampening)
    buf = fresh ? d : fma_rn(d, s.one_minus_dampening, mul_rn(buf, s.momentum));
    d = s.nesterov ? fma_rn(buf, s.momentum, d) : buf;  // grad.add(buf, alpha=momentum)
  }
  return fma_rn(d, s.neg_lr, w);  // param.add_(grad, alpha=-lr)
}

// ---- Adam and AdamW (torch.optim.Adam, _single_tensor_adam; AdamW is decoupled weight decay)

struct AdamScalars {
  float weight_decay;     // float(weight_decay): Adam's L2 term, with coupled_decay
  float decay;            // float(1 - lr * weight_decay): AdamW's factor, with decoupled_decay
  float lerp_weight;      // float(1 - beta1)
  float beta2;            // float(beta2)
  float one_minus_beta2;  // float(1 - beta2)
  float eps;              // float(eps)
  bool coupled_decay;     // Adam with weight_decay != 0
  bool decoupled_decay;   // AdamW with weight_decay != 0
  bool maximize;
};

// First half of a step: the moments m and v replaced by their new values; returns the weight the
// update applies to (w, decayed by AdamW's factor).
LPSIM_FN float adam_moments(float w, float g, float& m, float& v, const AdamScalars& s) {
  float d = s.maximize ? neg(g) : g;                      // grad = -grad (torch.neg)
  if (s.decoupled_decay) w = mul_rn(w, s.decay);          // param.mul_(1 - lr * weight_decay)
  if (s.coupled_decay) d = fma_rn(w, s.weight_decay, d);  // grad.add(param, alpha=weight_decay)
  // exp_avg.lerp_(grad, 1 - beta1)
  const float diff = sub_rn(d, m);
  const bool small = std::fabs(s.lerp_weight) < 0.5f;
  m = small ? fma_rn(s.lerp_weight, diff, m) : fma_rn(sub_rn(s.lerp_weight, 1.0f), diff, d);
  // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
#if defined(__CUDA_ARCH__)
  v = fma_rn(s.one_minus_beta2, mul_rn(d, d), mul_rn(v, s.beta2));
#else
  v = fma_rn(mul_rn(s.one_minus_beta2, d), d, mul_rn(v, s.beta2));
#endif
  return w;
}

// Second half: the new weight from w (adam_moments' result), the new m, root = torch's sqrt of the
// new v, bias2_sqrt = float((1 - beta2^step) ** 0.5) and neg_step_size = float(-lr / (1 -
// beta1^step)).
LPSIM_FN float adam_update(float w, float m, float root, float bias2_sqrt, float neg_step_size,
                           const AdamScalars& s) {
  // (sqrt / bias2_sqrt).add_(eps), then param.addcdiv_(m, denom, value=-step_size)
#if defined(__CUDA_ARCH__)
  const float denom = add_rn(mul_rn(root, div_rn(1.0f, bias2_sqrt)), s.eps);
  return fma_rn(neg_step_size, div_rn(m, denom), w);
#else
  const float denom = add_rn(div_rn(root, bias2_sqrt), s.eps);
  return add_rn(w, div_rn(mul_rn(neg_step_size, m), denom));
#endif
}

}  // namespace lpsim
