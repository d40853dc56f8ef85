// The fused optimizer step op (a fragment of the lpsim library), behind lpsim/optim/fused.py:
//
//   optim_step_   one SGD or Adam/AdamW step of a list of float32 parameters with OptimLP's
//                 roundings (gradient, states, accumulator, weight), in one pass over the elements
//
// Per parameter i the lists hold its parameter, gradient, first and second state and accumulator
// (an empty tensor where absent), all float32, contiguous, of one shape. Each of the four rounding
// categories (grad, state, acc, weight) has a grid, a rule (-1: not rounded), rbits and a seed
// (seeds[k]); offsets holds five stream offsets per parameter (grad, state1, state2, acc, weight).
// `scalars` are the hyperparameters of the algorithm (0: SGD, 1: Adam), `per_parameter` one value
// per parameter for SGD (1: the momentum buffer is new) and two for Adam (-step_size,
// bias_correction2 ** 0.5). lpsim/optim/fused.py computes them; the checks here guard against
// direct calls. The CPU loop (cpu/optim_step.h) and the CUDA kernel (cuda/optim_step.h) take the
// same configuration (optim_step_config.h).
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <vector>

#include "checks.h"
#include "cpu/optim_step.h"
#include "multi_tensor.h"
#include "optim_step_config.h"

#if defined(LPSIM_WITH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda/optim_step.h"
#endif

// MKL's vector square root, which torch's CPU sqrt calls for float32 when torch is built with MKL
// (ATen/cpu/vml.h): a weak reference, null where no MKL is loaded.
extern "C" void vmsSqrt(int n, const float* a, float* r, long long mode) __attribute__((weak));

namespace lpsim {
namespace {

// torch's float32 sqrt on the CPU: MKL's vmsSqrt in torch's mode (VML_HA | VML_FTZDAZ_OFF |
// VML_ERRMODE_IGNORE), which is faithful but not always correctly rounded, where torch uses MKL;
// else the correctly rounded std::sqrt that ATen's own vectorised kernel computes.
void mkl_sqrt(const float* x, float* y, int64_t n) {
  constexpr long long kTorchMode = 0x2 | 0x140000 | 0x100;
  vmsSqrt(static_cast<int>(n), x, y, kTorchMode);
}
void std_sqrt(const float* x, float* y, int64_t n) {
  for (int64_t k = 0; k < n; ++k) y[k] = std::sqrt(x[k]);
}
cpu::SqrtSpan torch_sqrt() { return at::hasMKL() && vmsSqrt != nullptr ? mkl_sqrt : std_sqrt; }

// Category k's rounder from its grid and the op's lists.
Rounder rounder(const GridSpec& grid, at::IntArrayRef roundings, at::IntArrayRef rbits,
                const at::Tensor& seeds, size_t k) {
  Rounder r{};
  r.active = roundings[k] >= 0;
  if (!r.active) return r;
  r.grid = grid_spec(Dtype::float32, grid);
  r.rounding = rounding_of(roundings[k]);
  r.random = random_spec(r.rounding, rbits[k], seeds[static_cast<int64_t>(k)], 0);
  return r;
}

// The data of list[i], checked against the parameter (contiguous float32 of its shape, on its
// device); nullptr for an empty tensor.
float* data_of(at::TensorList list, size_t i, const at::Tensor& param, const char* name) {
  TORCH_CHECK(list.size() > i, "lpsim: ", name, " must hold one tensor per parameter");
  const at::Tensor& t = list[i];
  if (t.numel() == 0) return nullptr;  // absent (an empty parameter has nothing to step)
  TORCH_CHECK_TYPE(
      t.scalar_type() == at::kFloat && t.device() == param.device() && t.is_contiguous(),
      "lpsim: ", name, "[", i, "] must be a contiguous float32 tensor on ", param.device());
  TORCH_CHECK(t.sizes() == param.sizes(), "lpsim: ", name, "[", i,
              "] must have the parameter's shape ", param.sizes(), ", got ", t.sizes());
  return t.data_ptr<float>();
}

// optim_step_'s parameters (the schema's, in its order), and the same names as arguments.
#define LPSIM_STEP_PARAMS                                                                         \
  at::TensorList params, at::TensorList grads, at::TensorList states1, at::TensorList states2,    \
      at::TensorList accumulators,                                                                \
      LPSIM_GRID_PARAMS(grad_) LPSIM_GRID_PARAMS(state_) LPSIM_GRID_PARAMS(acc_)                  \
          LPSIM_GRID_PARAMS(weight_) at::IntArrayRef roundings,                                   \
      at::IntArrayRef rbits, const at::Tensor &seeds, at::IntArrayRef offsets, int64_t algorithm, \
      at::ArrayRef<double> scalars, at::ArrayRef<double> per_parameter
#define LPSIM_STEP_VALUES                                                        \
  params, grads, states1, states2, accumulators,                                 \
      LPSIM_GRID_VALUES(grad_) LPSIM_GRID_VALUES(state_) LPSIM_GRID_VALUES(acc_) \
          LPSIM_GRID_VALUES(weight_) roundings,                                  \
      rbits, seeds, offsets, algorithm, scalars, per_parameter

// The op's arguments, checked: the configuration, and each parameter's tensors and size.
struct StepArguments {
  StepConfig config;
  std::vector<StepTensors> tensors;
  std::vector<int64_t> numels;
};

StepArguments step_arguments(LPSIM_STEP_PARAMS) {
  TORCH_CHECK(roundings.size() == 4 && rbits.size() == 4 && seeds.numel() == 4,
              "lpsim: roundings, rbits and seeds must hold 4 values (grad, state, acc, weight)");
  TORCH_CHECK(algorithm == 0 || algorithm == 1, "lpsim: algorithm must be 0 (SGD) or 1 (Adam)");
  const size_t n = params.size();
  const size_t per = algorithm == 0 ? 1 : 2;
  TORCH_CHECK(offsets.size() == 5 * n && per_parameter.size() == per * n,
              "lpsim: offsets must hold 5 values per parameter and per_parameter ", per);
  StepArguments args;
  StepConfig& c = args.config;
  c.algorithm = static_cast<Algorithm>(algorithm);
  if (algorithm == 0) {
    TORCH_CHECK(scalars.size() == 7, "lpsim: SGD takes 7 scalars");
    c.sgd = SgdScalars{static_cast<float>(scalars[0]),
                       static_cast<float>(scalars[1]),
                       static_cast<float>(scalars[2]),
                       static_cast<float>(scalars[3]),
                       scalars[0] != 0,
                       scalars[1] != 0,
                       scalars[4] != 0,
                       scalars[5] != 0};
  } else {
    TORCH_CHECK(scalars.size() == 10, "lpsim: Adam takes 10 scalars");
    c.adam = AdamScalars{static_cast<float>(scalars[0]),
                         static_cast<float>(scalars[1]),
                         static_cast<float>(scalars[2]),
                         static_cast<float>(scalars[3]),
                         static_cast<float>(scalars[4]),
                         static_cast<float>(scalars[5]),
                         scalars[6] != 0,
                         scalars[7] != 0,
                         scalars[8] != 0};
  }
  const double scale = scalars.back();
  c.scale_grad = scale != 1;
  c.grad_scale = static_cast<float>(scale);
  c.grad = rounder(GridSpec{LPSIM_GRID_VALUES(grad_)}, roundings, rbits, seeds, 0);
  c.state = rounder(GridSpec{LPSIM_GRID_VALUES(state_)}, roundings, rbits, seeds, 1);
  c.acc = rounder(GridSpec{LPSIM_GRID_VALUES(acc_)}, roundings, rbits, seeds, 2);
  c.weight = rounder(GridSpec{LPSIM_GRID_VALUES(weight_)}, roundings, rbits, seeds, 3);

  args.tensors.resize(n);
  args.numels.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK_TYPE(
        p.scalar_type() == at::kFloat && p.device() == params[0].device() && p.is_contiguous(),
        "lpsim: params[", i, "] must be a contiguous float32 tensor on ", params[0].device());
    StepTensors& t = args.tensors[i];
    t.param = p.data_ptr<float>();
    t.grad = data_of(grads, i, p, "grads");
    t.state1 = data_of(states1, i, p, "states1");
    t.state2 = data_of(states2, i, p, "states2");
    t.acc = data_of(accumulators, i, p, "accumulators");
    TORCH_CHECK(algorithm == 0 || t.grad == nullptr || (t.state1 && t.state2),
                "lpsim: Adam needs both states of every parameter with a gradient");
    if (algorithm == 0) {
      t.fresh = per_parameter[i] != 0;
    } else {
      t.neg_step_size = static_cast<float>(per_parameter[2 * i]);
      t.bias2_sqrt = static_cast<float>(per_parameter[2 * i + 1]);
    }
    for (size_t k = 0; k < 5; ++k) t.offset[k] = static_cast<uint64_t>(offsets[5 * i + k]);
    args.numels[i] = p.numel();
  }
  return args;
}

void optim_step_cpu(LPSIM_STEP_PARAMS) {
  const StepArguments args = step_arguments(LPSIM_STEP_VALUES);
  const cpu::SqrtSpan sqrt = torch_sqrt();
  for_each_span(args.numels, [&](const Span& s) {
    cpu::optim_step(args.config, sqrt, args.tensors[s.tensor], s.begin, s.end);
  });
}

#if defined(LPSIM_WITH_CUDA)
// The kernels run on the parameters' device, on its current stream.
void optim_step_cuda(LPSIM_STEP_PARAMS) {
  const StepArguments args = step_arguments(LPSIM_STEP_VALUES);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(params[0].device().index()).stream();
  gpu::optim_step(args.config, args.tensors.data(), args.numels.data(),
                  static_cast<int64_t>(args.tensors.size()), stream);
}
#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(lpsim, m) {
  std::string grids;
  for (const char* prefix : {"grad_", "state_", "acc_", "weight_"}) {
    grids += grid_schema(prefix) + ", ";
  }
  m.def(("optim_step_(Tensor(a!)[] params, Tensor(b!)[] grads, Tensor(c!)[] states1, "
         "Tensor(d!)[] states2, Tensor(e!)[] accumulators, " +
         grids +
         "int[] roundings, int[] rbits, Tensor seeds, int[] offsets, int algorithm, "
         "float[] scalars, float[] per_parameter) -> ()")
            .c_str());
}

TORCH_LIBRARY_IMPL(lpsim, CPU, m) { m.impl("optim_step_", optim_step_cpu); }

#if defined(LPSIM_WITH_CUDA)
TORCH_LIBRARY_IMPL(lpsim, CUDA, m) { m.impl("optim_step_", optim_step_cuda); }
#endif

}  // namespace lpsim
