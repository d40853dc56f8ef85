// The argument checks every op file shares (see checks.h).
#include "checks.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/Generator.h>

#include <climits>
#include <cmath>
#include <mutex>

namespace lpsim {

Dtype container_of(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat:
      return Dtype::float32;
    case at::kDouble:
      return Dtype::float64;
    case at::kBFloat16:
      return Dtype::bfloat16;
    case at::kHalf:
      return Dtype::float16;
    default:
      TORCH_CHECK_TYPE(false,
                       "lpsim: x must be a float32, float64, bfloat16 or float16 tensor, got ",
                       x.scalar_type());
  }
}

int container_man_bits(Dtype dtype) {
  switch (dtype) {
    case Dtype::float32:
      return Float32Container::man_bits;
    case Dtype::float64:
      return Float64Container::man_bits;
    case Dtype::bfloat16:
      return BFloat16Container::man_bits;
    case Dtype::float16:
      return Float16Container::man_bits;
  }
  return 0;
}

namespace {
template <class C>
const char* grid_problem(const GridSpec& spec) {
  Grid<C> g;
  return make_grid<C>(spec, g);
}
}  // namespace

GridSpec grid_spec(Dtype dtype, const GridSpec& spec) {
  // Far inside int32, so that make_grid's biased exponents cannot overflow.
  TORCH_CHECK(spec.keep <= 64 && spec.qmin > -4096 && spec.qmin < 4096 && spec.emin > -4096 &&
                  spec.emin < 4096,
              "lpsim: grid exponents out of range");
  const char* problem = nullptr;
  switch (dtype) {
    case Dtype::float32:
      problem = grid_problem<Float32Container>(spec);
      break;
    case Dtype::float64:
      problem = grid_problem<Float64Container>(spec);
      break;
    case Dtype::bfloat16:
      problem = grid_problem<BFloat16Container>(spec);
      break;
    case Dtype::float16:
      problem = grid_problem<Float16Container>(spec);
      break;
  }
  TORCH_CHECK(problem == nullptr, "lpsim: ", problem);
  return spec;
}

GridSpec sum_grid_spec(Dtype dtype, const GridSpec& spec) {
  // A sum may be rounded in a wider container than the result's, so the grid must not depend on
  // the container: lpsim.update.sum_grid gives the precision and the limits explicitly.
  TORCH_CHECK(spec.keep >= 0 && std::isfinite(spec.pos_limit) && std::isfinite(spec.neg_limit),
              "lpsim: the sum ops take grids with an explicit precision and finite limits "
              "(lpsim.update.sum_grid makes them), got keep=",
              spec.keep, ", limits ", spec.pos_limit, " and ", spec.neg_limit);
  return grid_spec(dtype, spec);
}

Rounding rounding_of(int64_t code) {
  TORCH_CHECK(code >= 0 && code < kNumRoundings, "lpsim: rounding code must be in [0, ",
              kNumRoundings, "), got ", code);
  return static_cast<Rounding>(code);
}

namespace {

// What torch.randint(2**63 - 1, ()) returns from the default CPU generator: its random64() modulo
// the range (ATen's uniform_int_from_to for ranges of 2^32 or more), under the generator's lock.
uint64_t draw_seed() {
  auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(
      std::nullopt, at::detail::getDefaultCPUGenerator());
  const std::lock_guard<std::mutex> lock(gen->mutex_);
  return gen->random64() % static_cast<uint64_t>(INT64_MAX);
}

}  // namespace

RandomSpec random_spec(Rounding rule, int64_t rbits, const Seed& seed, int64_t offset) {
  TORCH_CHECK(rbits >= 1 && rbits <= 32, "lpsim: rbits must be in [1, 32], got ", rbits);
  uint64_t bits = 0;
  if (seed.has_value()) {
    TORCH_CHECK(seed->scalar_type() == at::kLong && seed->numel() == 1 && seed->device().is_cpu(),
                "lpsim: seed must be a one-element int64 CPU tensor or None");
    bits = static_cast<uint64_t>(seed->item<int64_t>());
  } else if (is_stochastic(rule)) {
    bits = draw_seed();
  }
  return RandomSpec{bits, static_cast<uint64_t>(offset), static_cast<int32_t>(rbits)};
}

void check_out(const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(out.sizes() == x.sizes(), "lpsim: out must have the shape of x, ", x.sizes(),
              ", got ", out.sizes());
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "lpsim: out must have the dtype of x, ",
              x.scalar_type(), ", got ", out.scalar_type());
  TORCH_CHECK(out.device() == x.device(), "lpsim: out must be on the device of x");
  // out may be x itself (each element is read before it is written, and a block's maximum before
  // any of its elements), but not another view of the same memory: torch's own rule for out=.
  at::assert_no_internal_overlap(out);
  at::assert_no_partial_overlap(out, x);
}

}  // namespace lpsim
