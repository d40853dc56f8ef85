// Scaled formats (lpsim/scaled.py): one definition, shared by the CPU loops and the CUDA kernels,
// of which elements share a scale, how a block's scale follows from its largest magnitude, and how
// an element is encoded and decoded.
//
// A block's largest magnitude is the maximum of its elements' magnitude bits |u| as unsigned
// integers: monotone in the value for finite values, above every finite value for Inf and above Inf
// for NaN, so one maximum also says whether the block holds a NaN or an Inf (it is then NaN
// throughout, the OCP spec's NaN scale).
//
// Power-of-two scales are exact: the element is x / 2^e rounded once onto the element grid (in
// float64, which holds x / 2^e exactly for the 16- and 32-bit containers) and decodes to that times
// 2^e. Float scales follow the arithmetic the format defines (float32, or float64 for float64
// tensors), one IEEE operation at a time (ieee_ops.h): d = amax / elem_max, s = d rounded onto the
// scale grid, r = 1 / s, element = round(x * r), value = element * s (with a tensor scale t:
// d / t, (1 / t) / s and t * s).
#pragma once

#include <cstdint>
#include <type_traits>

#include "container.h"
#include "exact_sum.h"
#include "grid_spec.h"
#include "ieee_ops.h"
#include "round.h"

namespace lpsim {

// The codes of lpsim.scaled.SCALE_RULES, in order.
enum class ScaleRule : int32_t { floor = 0, ceil = 1, even = 2, rceil = 3, amax = 4 };

// ---- Which elements share a scale

// A contiguous tensor viewed as [outer][rows][cols][inner], cut into tiles of tile_rows x tile_cols
// over (rows, cols), separately for each outer and each inner index. A tile of one inner index is a
// block (one scale); a tile with all its inner indices is a group. Every Scaled.block is one of
// these (csrc/scaled_ops.cpp, scaled_layout):
//   blocks of n along dim d:  [prod(before d)][1][size d][prod(after d)], tiles 1 x n
//   the whole dim d:          the same with tiles 1 x size(d)
//   tiles r x c:              [prod(leading)][rows][cols][1], tiles r x c
//   the whole tensor:         [1][1][numel][1], one tile
// Within a group, tile row k is one contiguous run of (tile width) * inner elements.
struct ScaledLayout {
  int64_t outer, rows, cols, inner;
  int64_t tile_rows, tile_cols;

  LPSIM_HOST_DEVICE int64_t tiles_down() const { return (rows + tile_rows - 1) / tile_rows; }
  LPSIM_HOST_DEVICE int64_t tiles_across() const { return (cols + tile_cols - 1) / tile_cols; }
  LPSIM_HOST_DEVICE int64_t groups() const { return outer * tiles_down() * tiles_across(); }
  LPSIM_HOST_DEVICE int64_t blocks() const { return groups() * inner; }
};

// The tile of group g: its first element and its height and width (the last tiles may be smaller).
struct GroupTile {
  int64_t start;   // offset of the tile's first element (inner index 0)
  int64_t height;  // rows of the tile
  int64_t width;   // columns of the tile; a tile row is width * inner contiguous elements
};

LPSIM_HOST_DEVICE inline GroupTile group_tile(const ScaledLayout& l, int64_t g) {
  const int64_t across = l.tiles_across(), down = l.tiles_down();
  const int64_t tc = g % across;
  const int64_t tr = (g / across) % down;
  const int64_t o = g / (across * down);
  const int64_t r0 = tr * l.tile_rows, c0 = tc * l.tile_cols;
  GroupTile t;
  t.start = ((o * l.rows + r0) * l.cols + c0) * l.inner;
  t.height = l.rows - r0 < l.tile_rows ? l.rows - r0 : l.tile_rows;
  t.width = l.cols - c0 < l.tile_cols ? l.cols - c0 : l.tile_cols;
  return t;
}

// The block (scale index: group * inner + inner index) of the element at offset i.
LPSIM_HOST_DEVICE inline int64_t block_of(const ScaledLayout& l, int64_t i) {
  const int64_t in = i % l.inner;
  const int64_t c = (i / l.inner) % l.cols;
  const int64_t r = (i / (l.inner * l.cols)) % l.rows;
  const int64_t o = i / (l.inner * l.cols * l.rows);
  const int64_t g = (o * l.tiles_down() + r / l.tile_rows) * l.tiles_across() + c / l.tile_cols;
  return g * l.inner + in;
}

// ---- Scales

// What every block of one scaled format shares, as the op passes it (lpsim/scaled.py computes the
// format's facts; the tensor scale is filled in by the op when the format has one).
struct ScaledSpec {
  ScaleRule rule;
  GridSpec element;           // the saturating element grid
  int32_t element_emax;       // floor(log2(elem_max))
  int32_t element_precision;  // fraction bits of the element's largest binade
  double element_max;         // elem_max
  GridSpec scale;             // PowerOfTwo: exponents [scale.emin, log2(scale.pos_limit)]; Float
                              // scales: their grid
  bool two_level;             // a per-tensor scale t
  double tensor;              // t (two levels; else 1), NaN for a tensor with a NaN or Inf
  double tensor_reciprocal;   // 1 / t, rounded in the arithmetic's precision
};

// The container of a scaled format's arithmetic for tensors of container C: float64 for float64,
// float32 otherwise.
template <class C>
using ScaledArithmetic =
    std::conditional_t<std::is_same_v<C, Float64Container>, Float64Container, Float32Container>;

// A block's scale. Power-of-two scales: 2^exponent. Float scales: the encoder multiplies by
// `reciprocal`, elements decode times `decode` (values of the arithmetic's type, held exactly).
struct BlockScale {
  bool finite;  // false: the block (or the tensor, for t) holds a NaN or an Inf
  int32_t exponent;
  double reciprocal;
  double decode;
};

// 2^k as a double, for |k| <= 1022.
LPSIM_FN double pow2_double(int32_t k) { return real_of(uint64_t(k + 1023) << 52); }

// 2^k in the arithmetic's type, for k within its normal or subnormal range.
LPSIM_FN float pow2_real(int32_t k, float) {
  return real_of(k >= -126 ? uint32_t(k + 127) << 23 : uint32_t(1) << (k + 149));
}
LPSIM_FN double pow2_real(int32_t k, double) { return pow2_double(k); }

// floor(log2(v)) of a positive finite double, by its bits (subnormals included).
LPSIM_FN int32_t floor_log2(uint64_t bits) {
  const int32_t field = static_cast<int32_t>(bits >> 52);
  return field > 0 ? field - 1023 : leading_bit(bits) - 1074;
}

// Whether a positive finite double is a power of two.
LPSIM_FN bool is_pow2(uint64_t bits) {
  const uint64_t fraction = bits & ((uint64_t(1) << 52) - 1);
  return bits >> 52 > 0 ? fraction == 0 : (fraction & (fraction - 1)) == 0;
}

// The tensor scale t = amax / (scale max * elem_max), at least 2^-126 / (the scale's smallest
// normal), so that 1 / (t * s) stays finite for every scale s (and an all-zero tensor has zeros);
// NaN when the tensor holds a NaN or an Inf. `amax` is the tensor's largest magnitude bits in
// container C.
template <class C>
LPSIM_FN void set_tensor_scale(ScaledSpec& s, typename C::word amax) {
  using K = ScaledArithmetic<C>;
  using T = RealOf<K>;
  if (amax >= C::inf_bits) {
    s.tensor = s.tensor_reciprocal = real_of(Float64Container::quiet_nan);
    return;
  }
  const T a = real_of(convert_exact<K, C>(amax));
  const T top = static_cast<T>(s.scale.pos_limit * s.element_max);  // both exact; product < 2^128
  T t = div_rn(a, top);
  const T smallest = pow2_real(-126 - static_cast<int32_t>(s.scale.emin), T());
  t = t < smallest ? smallest : t;
  s.tensor = t;
  s.tensor_reciprocal = div_rn(T(1), t);
}

// The scale of a block whose largest magnitude bits (in container C) are `amax`. `scale_grid` is
// the Float scale's grid in the arithmetic's container (unused for power-of-two scales).
template <class C>
LPSIM_FN BlockScale block_scale(typename C::word amax, const ScaledSpec& s,
                                const Grid<ScaledArithmetic<C>>& scale_grid) {
  using K = ScaledArithmetic<C>;
  using T = RealOf<K>;
  BlockScale b;
  b.finite = amax < C::inf_bits && s.tensor == s.tensor;
  b.exponent = 0;
  b.reciprocal = b.decode = 1;
  if (!b.finite) return b;
  const uint64_t a = convert_exact<Float64Container, C>(amax);  // amax as float64 bits, exact
  if (s.rule != ScaleRule::amax) {
    const int32_t emin = static_cast<int32_t>(s.scale.emin);
    const int32_t emax = floor_log2(bits_of_real(s.scale.pos_limit));
    int32_t e = emin;
    if (s.rule == ScaleRule::rceil) {
      const T d = div_rn(real_of(convert_exact<K, C>(amax)), static_cast<T>(s.element_max));
      const uint64_t db = bits_of_real(static_cast<double>(d));
      if (db != 0) e = floor_log2(db) + (is_pow2(db) ? 0 : 1);
    } else if (a != 0) {
      e = floor_log2(a) - s.element_emax;
      if (s.rule == ScaleRule::ceil) {
        e += is_pow2(a) ? 0 : 1;
      } else if (s.rule == ScaleRule::even && s.element_precision < 52) {
        // amax rounded to element_precision fraction bits, ties away: into the next binade when
        // its fraction rounds up to 1. Subnormal doubles have no such fraction to round (they only
        // occur for float64 tensors, whose scales then clamp to emin anyway).
        const uint64_t half = uint64_t(1) << (51 - s.element_precision);
        const uint64_t fraction = a & ((uint64_t(1) << 52) - 1);
        e += (a >> 52) > 0 && fraction + half >= (uint64_t(1) << 52) ? 1 : 0;
      }
    }
    b.exponent = e < emin ? emin : (e > emax ? emax : e);
    return b;
  }
  const T smallest = pow2_real(static_cast<int32_t>(s.scale.emin), T());
  const T largest = static_cast<T>(s.scale.pos_limit);
  T d = div_rn(real_of(convert_exact<K, C>(amax)), static_cast<T>(s.element_max));
  if (s.two_level) d = div_rn(d, static_cast<T>(s.tensor));
  d = d < smallest ? smallest : (d > largest ? largest : d);
  const T scale = real_of(round_to_grid<Rounding::nearest, K>(bits_of_real(d), scale_grid, 0, 0));
  if (s.two_level) {
    b.reciprocal = div_rn(static_cast<T>(s.tensor_reciprocal), scale);
    b.decode = mul_rn(static_cast<T>(s.tensor), scale);
  } else {
    b.reciprocal = div_rn(T(1), scale);
    b.decode = scale;
  }
  return b;
}

// ---- Elements

// The grid of container C's own values in container K (which holds them): what a value computed in
// K is rounded onto to be stored in C, to nearest with IEEE overflow to Inf.
template <class K, class C>
LPSIM_FN Grid<K> own_grid() {
  Grid<K> g;
  g.keep = C::man_bits;
  g.qmin = 1 - C::bias - C::man_bits + K::bias;
  g.flush_below = kNoFlush;
  g.min_positive = pow2_bits<K>(g.qmin);
  g.pos_limit = g.neg_limit = convert_exact<K, C>(C::inf_bits - 1);
  g.pos_overflow = g.neg_overflow = g.pos_inf = g.neg_inf = K::inf_bits;
  g.zero_sign = K::sign_mask;
  g.code_parity = 0;
  return g;
}

// What an element needs besides its block's scale.
template <class C>
struct ElementGrids {
  Grid<Float64Container> element;  // the saturating element grid, in float64
  Grid<ScaledArithmetic<C>> own;   // C's values in the arithmetic's container
};

template <class C>
ElementGrids<C> element_grids(const ScaledSpec& s) {
  ElementGrids<C> g;
  make_grid<Float64Container>(s.element, g.element);  // validated by the op
  g.own = own_grid<ScaledArithmetic<C>, C>();
  return g;
}

// The value the element with bits u (container C) decodes to, in block scale b, rounded by rule R
// (random: the element's word; mask: random_mask(rbits)).
template <Rounding R, class C, bool kPowerOfTwo>
LPSIM_FN typename C::word scaled_element(typename C::word u, const BlockScale& b,
                                         const ElementGrids<C>& g, uint32_t random, uint32_t mask) {
  using K = ScaledArithmetic<C>;
  using T = RealOf<K>;
  using F64 = Float64Container;
  double y;
  if constexpr (kPowerOfTwo) {
    y = mul_rn(real_of(convert_exact<F64, C>(u)), pow2_double(-b.exponent));
  } else {
    y = mul_rn(real_of(convert_exact<K, C>(u)), static_cast<T>(b.reciprocal));
  }
  const T q =
      static_cast<T>(real_of(round_to_grid<R, F64>(bits_of_real(y), g.element, random, mask)));
  const T v =
      kPowerOfTwo ? mul_rn(q, pow2_real(b.exponent, T())) : mul_rn(q, static_cast<T>(b.decode));
  typename K::word out = bits_of_real(v);
  if constexpr (!std::is_same_v<K, C>) out = round_to_grid<Rounding::nearest, K>(out, g.own, 0, 0);
  return b.finite ? convert_exact<C, K>(out) : C::quiet_nan;
}

}  // namespace lpsim
