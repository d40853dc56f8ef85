// What every op file (csrc/*_ops.cpp) shares: the argument checks, the grid's op arguments
// generated from LPSIM_GRID_FIELDS (lpsim/grid_spec.h), and the destination of a kernel. Each check
// raises a torch error naming the argument and its range. The Python layer validates formats, so
// these only guard against direct calls of torch.ops.lpsim with bad values.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/copy.h>
#include <ATen/ops/empty_like.h>
#include <lpsim/grid_spec.h>
#include <lpsim/types.h>

#include <optional>
#include <string>
#include <type_traits>

namespace lpsim {

// ---- A grid as op arguments, generated from LPSIM_GRID_FIELDS

// The grid's parameters in an op's C++ signature, named P##field, each followed by a comma: in
// every op a grid is followed by more arguments.
#define LPSIM_GRID_PARAM_(P, type, name) type P##name,
#define LPSIM_GRID_PARAMS(P) LPSIM_GRID_FIELDS(LPSIM_GRID_PARAM_, P)

// Those parameters in field order, to initialise a GridSpec: GridSpec{LPSIM_GRID_VALUES(P)}.
#define LPSIM_GRID_VALUE_(P, type, name) P##name,
#define LPSIM_GRID_VALUES(P) LPSIM_GRID_FIELDS(LPSIM_GRID_VALUE_, P)

// The schema type of a grid field's C++ type.
template <class T>
constexpr const char* schema_type() {
  if constexpr (std::is_same_v<T, int64_t>) {
    return "int";
  } else if constexpr (std::is_same_v<T, double>) {
    return "float";
  } else {
    static_assert(std::is_same_v<T, bool>, "a grid field is an int64_t, a double or a bool");
    return "bool";
  }
}

// The grid's arguments in schema text, "int keep, int qmin, ...", names prefixed by `prefix`.
inline std::string grid_schema(const std::string& prefix = "") {
  std::string s;
#define LPSIM_GRID_SCHEMA_(P, type, name) \
  s += std::string(schema_type<type>()) + " " + prefix + #name + ", ";
  LPSIM_GRID_FIELDS(LPSIM_GRID_SCHEMA_, )
#undef LPSIM_GRID_SCHEMA_
  s.resize(s.size() - 2);  // the last ", "
  return s;
}

// The arguments of the rule and its random words, after the grid in every op that rounds. The seed
// is a one-element int64 CPU tensor holding the 64 seed bits, or None: a stochastic rule then draws
// its seed from torch's default CPU generator (random_spec), so that a call without a seed creates
// no tensor.
constexpr const char* kRandomSchema = "int rounding, int rbits, Tensor? seed, int offset";
using Seed = std::optional<at::Tensor>;

// ---- Checks

Dtype container_of(const at::Tensor& x);  // TypeError for other dtypes
int container_man_bits(Dtype dtype);

// The grid checked against `dtype`: its exponents in range and its spacing and limits
// representable in the container.
GridSpec grid_spec(Dtype dtype, const GridSpec& grid);

// The grid of a sum op, checked against `dtype` (the result's container): like grid_spec, but the
// precision must be explicit (keep >= 0) and the limits finite, since the sum may be computed in a
// wider container. lpsim.update.sum_grid makes such grids.
GridSpec sum_grid_spec(Dtype dtype, const GridSpec& grid);

Rounding rounding_of(int64_t code);
// The random stream of a rounding by `rule`: rbits checked, and the seed read from its tensor or,
// for a stochastic rule without one, drawn from torch's default CPU generator as
// torch.randint(2**63 - 1, ()) draws it (lpsim._checks.draw_seed). Rules that draw no random words
// consume nothing from the generator.
RandomSpec random_spec(Rounding rule, int64_t rbits, const Seed& seed, int64_t offset);
void check_out(const at::Tensor& x, const at::Tensor& out);

// ---- The output tensor a kernel writes: `dst` itself when it is contiguous, else a contiguous
// temporary that finish() copies back. With `keep_values` the temporary starts as a copy of dst
// (for kernels that read and write the destination: the in-place multi-tensor ops).
struct Destination {
  at::Tensor target;
  at::Tensor buffer;

  explicit Destination(const at::Tensor& dst, bool keep_values = false)
      : target(dst),
        buffer(dst.is_contiguous() ? dst
               : keep_values       ? dst.contiguous()
                                   : at::empty_like(dst, at::MemoryFormat::Contiguous)) {}
  void finish() {
    if (!buffer.is_same(target)) target.copy_(buffer);
  }
};

}  // namespace lpsim
