// The lpsim operator library: schemas (TORCH_LIBRARY) and the CPU implementations.
//
// Two families of ops, each functional, in place (`_`) and with an output tensor (`_out`):
//   quantize_grid   Float and Fixed formats: one grid for every element (see round.h);
//   quantize_block  BlockFloat: a grid per block, from the block's largest finite magnitude.
// Arguments are the container-independent description that lpsim/formats.py computes; the Python
// layer validates formats, so the checks here only guard against direct calls with bad values.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <string>
#include <vector>

#include "ops.h"

namespace lpsim {

cpu::Dtype container_of(const at::Tensor& x) {
  switch (x.scalar_type()) {
    case at::kFloat: return cpu::Dtype::float32;
    case at::kDouble: return cpu::Dtype::float64;
    case at::kBFloat16: return cpu::Dtype::bfloat16;
    case at::kHalf: return cpu::Dtype::float16;
    default:
      TORCH_CHECK_TYPE(false, "lpsim: x must be a float32, float64, bfloat16 or float16 tensor, got ",
                       x.scalar_type());
  }
}

int container_man_bits(cpu::Dtype dtype) {
  switch (dtype) {
    case cpu::Dtype::float32: return Float32Container::man_bits;
    case cpu::Dtype::float64: return Float64Container::man_bits;
    case cpu::Dtype::bfloat16: return BFloat16Container::man_bits;
    case cpu::Dtype::float16: return Float16Container::man_bits;
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

GridSpec grid_spec(cpu::Dtype dtype, int64_t keep, int64_t qmin, int64_t emin, bool subnormals,
                   double pos_limit, double neg_limit, bool saturate, bool has_inf,
                   bool unsigned_zero) {
  TORCH_CHECK(keep <= 64 && qmin > -4096 && qmin < 4096 && emin > -4096 && emin < 4096,
              "lpsim: grid exponents out of range");
  const GridSpec spec{static_cast<int32_t>(keep), static_cast<int32_t>(qmin),
                      static_cast<int32_t>(emin), subnormals, pos_limit, neg_limit,
                      saturate, has_inf, unsigned_zero};
  const char* problem = nullptr;
  switch (dtype) {
    case cpu::Dtype::float32: problem = grid_problem<Float32Container>(spec); break;
    case cpu::Dtype::float64: problem = grid_problem<Float64Container>(spec); break;
    case cpu::Dtype::bfloat16: problem = grid_problem<BFloat16Container>(spec); break;
    case cpu::Dtype::float16: problem = grid_problem<Float16Container>(spec); break;
  }
  TORCH_CHECK(problem == nullptr, "lpsim: ", problem);
  return spec;
}

Rounding rounding_of(int64_t code) {
  TORCH_CHECK(code >= 0 && code < kNumRoundings, "lpsim: rounding code must be in [0, ",
              kNumRoundings, "), got ", code);
  return static_cast<Rounding>(code);
}

RandomSpec random_spec(int64_t rbits, const at::Tensor& seed, int64_t offset) {
  TORCH_CHECK(rbits >= 1 && rbits <= 32, "lpsim: rbits must be in [1, 32], got ", rbits);
  TORCH_CHECK(seed.scalar_type() == at::kLong && seed.numel() == 1 && seed.device().is_cpu(),
              "lpsim: seed must be a one-element int64 CPU tensor");
  return RandomSpec{static_cast<uint64_t>(seed.item<int64_t>()), static_cast<uint64_t>(offset),
                    static_cast<int32_t>(rbits)};
}

void check_block(const at::Tensor& x, int64_t wl, std::optional<int64_t> dim,
                 std::optional<int64_t> block_size) {
  const int man = container_man_bits(container_of(x));
  TORCH_CHECK(wl >= 2 && wl <= man + 2, "lpsim: wl must be in [2, ", man + 2, "] for a ",
              x.scalar_type(), " container, got ", wl);
  TORCH_CHECK(!(dim.has_value() && block_size.has_value()),
              "lpsim: give dim or block_size, not both");
  if (dim.has_value()) {
    TORCH_CHECK_INDEX(*dim >= 0 && *dim < std::max<int64_t>(x.dim(), 1), "lpsim: dim ", *dim,
                      " does not exist in a tensor of ", x.dim(), " dimensions");
  }
  if (block_size.has_value()) {
    TORCH_CHECK(*block_size >= 1, "lpsim: block_size must be >= 1, got ", *block_size);
  }
}

void check_out(const at::Tensor& x, const at::Tensor& out) {
  TORCH_CHECK(out.sizes() == x.sizes(), "lpsim: out must have the shape of x, ", x.sizes(),
              ", got ", out.sizes());
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "lpsim: out must have the dtype of x, ",
              x.scalar_type(), ", got ", out.scalar_type());
  TORCH_CHECK(out.device() == x.device(), "lpsim: out must be on the device of x");
}

BlockLayout block_layout(const at::Tensor& x, int64_t wl, std::optional<int64_t> dim,
                         std::optional<int64_t> block_size) {
  check_block(x, wl, dim, block_size);
  BlockLayout layout{block_size.has_value(), 1, block_size.value_or(1), 1, x.numel()};
  if (layout.by_size) {
    layout.row_len = x.dim() == 0 ? 1 : x.size(-1);
  } else if (dim.has_value() && x.dim() > 0) {
    layout.classes = x.size(*dim);
    layout.inner = 1;
    for (int64_t d = *dim + 1; d < x.dim(); ++d) layout.inner *= x.size(d);
  }
  return layout;
}

namespace {

// Elements per parallel task; a multiple of the random-word group so tasks do not share a group.
constexpr int64_t kGrain = 64 * kGroupSize;

void grid_cpu(const at::Tensor& x, const at::Tensor& dst, const GridSpec& spec, Rounding rounding,
              const RandomSpec& random) {
  const cpu::Dtype dtype = container_of(x);  // checked by grid_spec
  const at::Tensor src = x.contiguous();
  Destination out(dst);
  const void* xp = src.data_ptr();
  void* yp = out.buffer.data_ptr();
  at::parallel_for(0, src.numel(), kGrain, [&](int64_t begin, int64_t end) {
    cpu::quantize_grid(dtype, rounding, xp, yp, begin, end, spec, random);
  });
  out.finish();
}

void block_cpu(const at::Tensor& x, const at::Tensor& dst, int32_t wl, const BlockLayout& layout,
               Rounding rounding, const RandomSpec& random) {
  const cpu::Dtype dtype = container_of(x);
  const at::Tensor src = x.contiguous();
  Destination out(dst);
  const void* xp = src.data_ptr();
  void* yp = out.buffer.data_ptr();
  const int64_t n = src.numel();
  if (n == 0) return out.finish();

  if (layout.by_size) {
    const int64_t rows = n / layout.row_len;
    const int64_t blocks = rows * ((layout.row_len + layout.block_size - 1) / layout.block_size);
    const int64_t grain = std::max<int64_t>(1, kGrain / layout.block_size);
    at::parallel_for(0, blocks, grain, [&](int64_t b, int64_t e) {
      cpu::quantize_blocks(dtype, rounding, xp, yp, b, e, layout.row_len, layout.block_size, wl,
                           random);
    });
    return out.finish();
  }

  // Each task keeps its own running maxima; max is exact and order-free, so any split gives the
  // same result.
  const int64_t classes = layout.classes, inner = layout.inner;
  const int64_t threads = at::get_num_threads();
  std::vector<uint64_t> partial(static_cast<size_t>(threads * classes), 0);
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    uint64_t* mine = partial.data() + at::get_thread_num() * classes;
    cpu::max_abs_classes(dtype, xp, begin, end, inner, classes, mine);
  });
  std::vector<uint64_t> class_max(static_cast<size_t>(classes), 0);
  for (int64_t t = 0; t < threads; ++t) {
    for (int64_t c = 0; c < classes; ++c) {
      class_max[c] = std::max(class_max[c], partial[t * classes + c]);
    }
  }
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    cpu::quantize_block_classes(dtype, rounding, xp, yp, begin, end, inner, classes,
                                class_max.data(), wl, random);
  });
  out.finish();
}

// Test hook: the random words of elements [start, start + count) under (seed, offset). `kernels`
// chooses between the generator the CPU kernels use (whole groups, vectorised where the CPU can)
// and the core's per-element definition random_word(); both must agree with each other and with
// lpsim.reference.
at::Tensor random_words_cpu(const at::Tensor& seed, int64_t offset, int64_t start, int64_t count,
                            bool kernels) {
  TORCH_CHECK(start >= 0 && count >= 0, "lpsim: start and count must be >= 0");
  const RandomSpec r = random_spec(32, seed, offset);
  const PhiloxKey key = make_philox_key(r.seed, r.offset);
  at::Tensor words = at::empty({count}, at::TensorOptions().dtype(at::kLong));
  int64_t* w = words.data_ptr<int64_t>();
  uint32_t group_words[kGroupSize];
  int64_t cached = -1;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t index = start + i;
    if (!kernels) {
      w[i] = random_word(static_cast<uint64_t>(index), key);
      continue;
    }
    if (index / kGroupSize != cached) {
      cached = index / kGroupSize;
      cpu::philox_group(static_cast<uint64_t>(cached), key, group_words);
    }
    w[i] = group_words[index % kGroupSize];
  }
  return words;
}

}  // namespace

TORCH_LIBRARY(lpsim, m) {
  const char* grid_args =
      "int keep, int qmin, int emin, bool subnormals, float pos_limit, float neg_limit, "
      "bool saturate, bool has_inf, bool unsigned_zero, int rounding, int rbits, Tensor seed, "
      "int offset";
  const char* block_args =
      "int wl, int? dim, int? block_size, int rounding, int rbits, Tensor seed, int offset";
  const auto def = [&m](const std::string& schema) { m.def(schema.c_str()); };
  def(std::string("quantize_grid(Tensor x, ") + grid_args + ") -> Tensor");
  def(std::string("quantize_grid_(Tensor(a!) x, ") + grid_args + ") -> ()");
  def(std::string("quantize_grid_out(Tensor x, ") + grid_args + ", *, Tensor(a!) out) -> ()");
  def(std::string("quantize_block(Tensor x, ") + block_args + ") -> Tensor");
  def(std::string("quantize_block_(Tensor(a!) x, ") + block_args + ") -> ()");
  def(std::string("quantize_block_out(Tensor x, ") + block_args + ", *, Tensor(a!) out) -> ()");
  m.def("random_words(Tensor seed, int offset, int start, int count, bool kernels) -> Tensor");
}

TORCH_LIBRARY_IMPL(lpsim, CPU, m) {
  register_quantize_ops<grid_cpu, block_cpu>(m);
  m.impl("random_words", random_words_cpu);
}

}  // namespace lpsim
