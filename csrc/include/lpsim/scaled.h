// Scaled formats (lpsim/scaled.py): one definition, shared by the CPU loops and the CUDA kernels,
// of which elements share a scale, how a block's scale follows from its largest magnitude, and how
// an element is encoded and decoded.
//
// A block's largest magnitude is the maximum of its elements' magnitude bits |u| as unsigned
// integers: monotone in the value for finite values, above every finite value for Inf and above Inf
// for NaN, so one maximum also says whether the block holds a NaN or an Inf (it is then NaN
// throughout, the OCP spec's NaN scale).
//
// Power-of-two scales are exact: the element is x / 2^e rounded once onto the element grid, and
// decodes to that times 2^e (rounded to the tensor's dtype). Where the element grid shifted by e
// (every exponent raised by e) fits the tensor's container, that is x rounded onto the shifted grid
// in the container itself (shifted_element_grid; always so for float64). Elsewhere x / 2^e is
// rounded in float64, which holds it exactly for the 16- and 32-bit containers, and the value
// rounded again to the container; for the 16-bit containers that equals x rounded onto the shifted
// grid in float32 where that fits (shifted_arithmetic_element). Float scales follow the arithmetic
// the format defines (float32, or float64 for float64 tensors), one IEEE operation at a time
// (ieee_ops.h): d = amax / elem_max, s = d rounded onto the scale grid, r = 1 / s,
// element = round(x * r), value = element * s (with a tensor scale t: d / t, (1 / t) / s and
// t * s).
//
// Rounding does not depend on the container it is computed in: a value that two containers hold
// exactly, rounded onto one grid that both hold (its finest spacing and its limits representable),
// gives the same value in both, by every rule, the stochastic ones included (the discarded fraction
// and its top 32 bits are those of the value, whatever the container's width).
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
  // The positions (rows x columns) of a full tile, as many as any tile has.
  LPSIM_HOST_DEVICE int64_t positions() const {
    return (tile_rows < rows ? tile_rows : rows) * (tile_cols < cols ? tile_cols : cols);
  }
};

// The tile of group g: its first element and its height and width (the last tiles may be smaller).
struct GroupTile {
  int64_t start;   // offset of the tile's first element (inner index 0)
  int64_t height;  // rows of the tile
  int64_t width;   // columns of the tile; a tile row is width * inner contiguous elements
};

// The tile in tile row tr and tile column tc of outer index o.
LPSIM_HOST_DEVICE inline GroupTile tile_at(const ScaledLayout& l, int64_t o, int64_t tr,
                                           int64_t tc) {
  const int64_t r0 = tr * l.tile_rows, c0 = tc * l.tile_cols;
  GroupTile t;
  t.start = ((o * l.rows + r0) * l.cols + c0) * l.inner;
  t.height = l.rows - r0 < l.tile_rows ? l.rows - r0 : l.tile_rows;
  t.width = l.cols - c0 < l.tile_cols ? l.cols - c0 : l.tile_cols;
  return t;
}

// Groups are numbered row-major over (outer, tile row, tile column).
LPSIM_HOST_DEVICE inline GroupTile group_tile(const ScaledLayout& l, int64_t g) {
  const int64_t across = l.tiles_across(), down = l.tiles_down();
  return tile_at(l, g / (across * down), (g / across) % down, g % across);
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

// block_of for consecutive elements, without its divisions for each one (host loops): block() is
// block_of(l, i) for the element i the cursor stands at; run() elements from it on lie in that
// block consecutively (more may follow further on), and advance(k), k <= run(), moves the cursor to
// element i + k.
class BlockCursor {
 public:
  BlockCursor(const ScaledLayout& l, int64_t i)
      : l_(l), down_(l.tiles_down()), across_(l.tiles_across()) {
    in_ = i % l.inner;
    c_ = (i / l.inner) % l.cols;
    r_ = (i / (l.inner * l.cols)) % l.rows;
    o_ = i / (l.inner * l.cols * l.rows);
    tc_ = c_ / l.tile_cols;
    tr_ = r_ / l.tile_rows;
    c_in_tile_ = c_ % l.tile_cols;
    r_in_tile_ = r_ % l.tile_rows;
  }

  int64_t block() const { return ((o_ * down_ + tr_) * across_ + tc_) * l_.inner + in_; }

  // With inner indices, the next element lies in another block; otherwise the rest of the tile's
  // row does not.
  int64_t run() const {
    if (l_.inner > 1) return 1;
    const int64_t in_tile = l_.tile_cols - c_in_tile_, in_row = l_.cols - c_;
    return in_tile < in_row ? in_tile : in_row;
  }

  void advance(int64_t k) {
    if (k < run()) {  // inner == 1, within the tile's row
      c_ += k;
      c_in_tile_ += k;
      return;
    }
    // To the start of the next run: the next inner index, tile or row.
    if (l_.inner > 1 && ++in_ < l_.inner) return;
    in_ = 0;
    c_ += l_.inner > 1 ? 1 : k;
    if (c_ < l_.cols) {
      c_in_tile_ = (c_in_tile_ + (l_.inner > 1 ? 1 : k)) % l_.tile_cols;
      tc_ += c_in_tile_ == 0 ? 1 : 0;
      return;
    }
    c_ = c_in_tile_ = tc_ = 0;
    if (++r_ < l_.rows) {
      if (++r_in_tile_ == l_.tile_rows) r_in_tile_ = 0, ++tr_;
      return;
    }
    r_ = r_in_tile_ = tr_ = 0;
    ++o_;
  }

 private:
  ScaledLayout l_;
  int64_t down_, across_;
  int64_t o_, r_, c_, in_;         // the element's indices in [outer][rows][cols][inner]
  int64_t tr_, tc_;                // its tile row and column
  int64_t r_in_tile_, c_in_tile_;  // its row and column within the tile
};

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

// The bits of a finite container-C value in the arithmetic's container: convert_exact, without
// the branches (for Inf, NaN and zero, and a bit scan for subnormals) that keep a loop from
// vectorising. Only float16 needs more than convert_exact's shift: its normal values are
// re-biased, its subnormals (k times its finest spacing) converted as the integer k. Any input
// gives some value, so that a loop may run over a block it then discards.
template <class C>
LPSIM_FN typename ScaledArithmetic<C>::word to_arithmetic(typename C::word u) {
  using K = ScaledArithmetic<C>;
  if constexpr (!std::is_same_v<C, Float16Container>) {
    return convert_exact<K, C>(u);
  } else {
    constexpr int kShift = K::man_bits - C::man_bits;
    const uint32_t sign = (u & C::sign_mask)
                          << (K::exp_bits + K::man_bits - C::exp_bits - C::man_bits);
    const uint32_t a = u & C::abs_mask;
    const uint32_t normal = (a << kShift) + (uint32_t(K::bias - C::bias) << K::man_bits);
    const float finest = pow2_real(1 - C::bias - C::man_bits, float());
    const uint32_t subnormal =
        bits_of_real(mul_rn(static_cast<float>(static_cast<int32_t>(a)), finest));
    return sign | select(a <= C::man_mask, subnormal, normal);
  }
}

// The container-C bits of v, a value of the arithmetic's container that C holds or +-Inf (a value
// rounded onto C's own grid): convert_exact without its branches (see to_arithmetic). Other
// inputs (NaN) give some value.
template <class C>
LPSIM_FN typename C::word from_arithmetic(typename ScaledArithmetic<C>::word v) {
  using K = ScaledArithmetic<C>;
  if constexpr (!std::is_same_v<C, Float16Container>) {
    return convert_exact<C, K>(v);
  } else {
    constexpr int kShift = K::man_bits - C::man_bits;
    const uint32_t sign =
        (v >> (K::exp_bits + K::man_bits - C::exp_bits - C::man_bits)) & C::sign_mask;
    const uint32_t a = v & K::abs_mask;
    const uint32_t normal = (a >> kShift) - (uint32_t(K::bias - C::bias) << C::man_bits);
    // Below C's smallest normal, v is k times C's finest spacing: k converted as an integer (from
    // at most the smallest normal, so that the conversion is defined for any input).
    const uint32_t smallest_normal = uint32_t(K::bias - C::bias + 1) << K::man_bits;
    const float scaled =
        mul_rn(real_of(min_of(a, smallest_normal)), pow2_real(C::bias + C::man_bits - 1, float()));
    const uint32_t subnormal = static_cast<uint32_t>(static_cast<int32_t>(scaled));
    const uint32_t magnitude = select(a < smallest_normal, subnormal, normal);
    return sign | select(a == K::inf_bits, C::inf_bits, magnitude);
  }
}

// A Float scale's factors for a finite block whose largest magnitude bits (in container C) are
// `amax`: the encoder multiplies by `reciprocal`, elements decode times `decode`. Without a tensor
// scale, t = 1 and 1 / t = 1 make the divisions by t and the product with it exact no-ops, so one
// branch-free formula serves both (and a loop over blocks vectorises). `scale_grid` is the scale's
// grid in the arithmetic's container.
template <class C>
LPSIM_FN void float_scale_factors(typename C::word amax, const ScaledSpec& s,
                                  const Grid<ScaledArithmetic<C>>& scale_grid,
                                  RealOf<ScaledArithmetic<C>>& reciprocal,
                                  RealOf<ScaledArithmetic<C>>& decode) {
  using K = ScaledArithmetic<C>;
  using T = RealOf<K>;
  const T smallest = pow2_real(static_cast<int32_t>(s.scale.emin), T());
  const T largest = static_cast<T>(s.scale.pos_limit);
  const T t = static_cast<T>(s.tensor);
  T d = div_rn(real_of(to_arithmetic<C>(amax)), static_cast<T>(s.element_max));
  d = div_rn(d, t);
  d = min_of(max_of(d, smallest), largest);
  const T scale = real_of(round_to_grid<Rounding::nearest, K>(bits_of_real(d), scale_grid, 0, 0));
  reciprocal = div_rn(static_cast<T>(s.tensor_reciprocal), scale);
  decode = mul_rn(t, scale);
}

// Whether a block whose largest magnitude bits are `amax` is finite (and so is the tensor scale).
template <class C>
LPSIM_FN bool finite_block(typename C::word amax, const ScaledSpec& s) {
  return amax < C::inf_bits && s.tensor == s.tensor;
}

// The scale of a block whose largest magnitude bits (in container C) are `amax`. `scale_grid` is
// the Float scale's grid in the arithmetic's container (unused for power-of-two scales).
template <class C>
LPSIM_FN BlockScale block_scale(typename C::word amax, const ScaledSpec& s,
                                const Grid<ScaledArithmetic<C>>& scale_grid) {
  using K = ScaledArithmetic<C>;
  using T = RealOf<K>;
  BlockScale b;
  b.finite = finite_block<C>(amax, s);
  b.exponent = 0;
  b.reciprocal = b.decode = 1;
  if (!b.finite) return b;
  if (s.rule != ScaleRule::amax) {
    const uint64_t a = convert_exact<Float64Container, C>(amax);  // amax as float64 bits, exact
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
  T reciprocal, decode;
  float_scale_factors<C>(amax, s, scale_grid, reciprocal, decode);
  b.reciprocal = reciprocal;
  b.decode = decode;
  return b;
}

// ---- Element grids

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

// What an element needs besides its block's scale: the saturating element grid in three
// containers (the op checked that it fits C, hence also the wider ones).
template <class C>
struct ElementGrids {
  Grid<Float64Container> element;        // in float64: power-of-two scales (x / 2^e)
  Grid<ScaledArithmetic<C>> arithmetic;  // in the arithmetic's container: Float scales
  Grid<C> container;                     // in C: what shifted_element_grid shifts
  Grid<ScaledArithmetic<C>> own;         // C's values in the arithmetic's container
};

template <class C>
ElementGrids<C> element_grids(const ScaledSpec& s) {
  ElementGrids<C> g;
  make_grid<Float64Container>(s.element, g.element);  // validated by the op
  make_grid<ScaledArithmetic<C>>(s.element, g.arithmetic);
  make_grid<C>(s.element, g.container);
  g.own = own_grid<ScaledArithmetic<C>, C>();
  return g;
}

// ---- Power-of-two scales in the container

// The biased exponent of a positive finite container value's leading one (<= 0 for subnormals).
template <class C>
LPSIM_FN int32_t binade(typename C::word v) {
  const int32_t field = static_cast<int32_t>(v >> C::man_bits);
  return field > 0 ? field : leading_bit(v) - C::man_bits + 1;
}

// The bits of v * 2^e for a positive finite container value v, where v * 2^e is itself a
// container value (the caller checks: finite, and a multiple of the container's finest spacing).
template <class C>
LPSIM_FN typename C::word times_pow2(typename C::word v, int32_t e) {
  using W = typename C::word;
  constexpr int kMan = C::man_bits;
  // v = sig * 2^(b - bias - kMan) with sig's leading one at bit kMan, b = binade(v).
  const int32_t b = binade<C>(v);
  const int32_t field = static_cast<int32_t>(v >> kMan);
  const W sig = field > 0 ? (v & C::man_mask) | (W(1) << kMan) : W(v << (1 - b));
  const int32_t exponent = b + e;
  if (exponent >= 1) return (W(exponent) << kMan) | (sig & C::man_mask);
  // Subnormal: sig * 2^(exponent - bias - kMan) is sig >> (1 - exponent) finest spacings.
  return W(sig >> (1 - exponent));
}

// What an overflow or Inf outcome of the element grid becomes on the grid shifted by 2^e: a limit
// (saturating formats) becomes the shifted limit; Inf and NaN stay.
template <class C>
LPSIM_FN typename C::word shifted_outcome(typename C::word v, const Grid<C>& element,
                                          typename C::word pos_limit, typename C::word neg_limit) {
  return v == element.pos_limit ? pos_limit : (v == element.neg_limit ? neg_limit : v);
}

// The element grid of a block with scale 2^e as a grid in container C: every value of `element`
// (the element grid in C, ElementGrids::container) times 2^e, its exponents (qmin, flush_below)
// raised by e. Rounding x onto it is rounding x / 2^e onto the element grid and multiplying by
// 2^e, which scaled_element computes, when every value of the shifted grid is exact in C: its
// finest spacing 2^(qmin + e) must be one of C's, and its limits finite in C. Otherwise
// scaled_element's values are rounded again onto C's own grid, a second rounding that no grid
// expresses. Returns whether the shifted grid fits C; `out` is set only then.
template <class C>
LPSIM_FN bool shifted_element_grid(const Grid<C>& element, int32_t e, Grid<C>& out) {
  using W = typename C::word;
  constexpr int32_t kTopField = (1 << C::exp_bits) - 2;  // the largest finite exponent field
  if (element.qmin + e < 1 - C::man_bits) return false;
  const W largest = element.pos_limit > element.neg_limit ? element.pos_limit : element.neg_limit;
  if (binade<C>(largest) + e > kTopField) return false;
  const W pos_limit = element.pos_limit > 0 ? times_pow2<C>(element.pos_limit, e) : W(0);
  const W neg_limit = element.neg_limit > 0 ? times_pow2<C>(element.neg_limit, e) : W(0);
  const bool flushes = element.flush_below != kNoFlush;
  out = element;
  out.qmin = element.qmin + e;
  out.flush_below = flushes ? element.flush_below + e : kNoFlush;
  out.min_positive = pow2_bits<C>((flushes ? element.flush_below : element.qmin) + e);
  out.pos_limit = pos_limit;
  out.neg_limit = neg_limit;
  out.pos_overflow = shifted_outcome<C>(element.pos_overflow, element, pos_limit, neg_limit);
  out.neg_overflow = shifted_outcome<C>(element.neg_overflow, element, pos_limit, neg_limit);
  out.pos_inf = shifted_outcome<C>(element.pos_inf, element, pos_limit, neg_limit);
  out.neg_inf = shifted_outcome<C>(element.neg_inf, element, pos_limit, neg_limit);
  return true;
}

// ---- Elements

// The value the element with bits u (a 16-bit container C) of a finite block with scale 2^e
// decodes to, where the element grid shifted by e does not fit C but fits the arithmetic's
// container K (`shifted`: shifted_element_grid in K): x, exact in K, rounded onto the shifted grid
// in K is scaled_element's x / 2^e rounded onto the element grid times 2^e, exactly; then rounded
// onto C's own grid (`own`), as scaled_element does.
template <Rounding R, class C>
LPSIM_FN typename C::word shifted_arithmetic_element(typename C::word u,
                                                     const Grid<ScaledArithmetic<C>>& shifted,
                                                     const Grid<ScaledArithmetic<C>>& own,
                                                     uint32_t random, uint32_t mask) {
  using K = ScaledArithmetic<C>;
  const typename K::word v = round_to_grid<R, K>(to_arithmetic<C>(u), shifted, random, mask);
  return from_arithmetic<C>(round_to_grid<Rounding::nearest, K>(v, own, 0, 0));
}

// The value element q (a value of the element grid) of a block with scale 2^e decodes to: q * 2^e
// in the arithmetic, rounded onto C's own grid (`own`, in the arithmetic's container).
template <class C>
LPSIM_FN typename ScaledArithmetic<C>::word decoded_pow2_element(
    RealOf<ScaledArithmetic<C>> q, int32_t e, const Grid<ScaledArithmetic<C>>& own) {
  using K = ScaledArithmetic<C>;
  typename K::word out = bits_of_real(mul_rn(q, pow2_real(e, RealOf<K>())));
  if constexpr (!std::is_same_v<K, C>) out = round_to_grid<Rounding::nearest, K>(out, own, 0, 0);
  return out;
}

// The value element q of a block with a Float scale decodes to: q * decode in the arithmetic,
// rounded onto C's own grid (`own`, in the arithmetic's container).
template <class C>
LPSIM_FN typename ScaledArithmetic<C>::word decoded_element(RealOf<ScaledArithmetic<C>> q,
                                                            RealOf<ScaledArithmetic<C>> decode,
                                                            const Grid<ScaledArithmetic<C>>& own) {
  using K = ScaledArithmetic<C>;
  typename K::word out = bits_of_real(mul_rn(q, decode));
  if constexpr (!std::is_same_v<K, C>) out = round_to_grid<Rounding::nearest, K>(out, own, 0, 0);
  return out;
}

// The value the element with bits u (container C) of a finite block with a Float scale decodes
// to: y = x * reciprocal rounded in the arithmetic, rounded onto the element grid in the
// arithmetic's container (which holds y and the grid exactly: the same as in float64), decoded
// (decoded_element), in C. A value of the format comes back unchanged by every rule: where x is
// the decoded value of the element nearest y, the result is x, although y, a rounding or two away
// from that element, would go a step down or up under a directed or stochastic rule. (The element
// nearest y is the one x decodes from wherever y's relative error, from a few roundings in the
// arithmetic and one into C, stays below half the element grid's spacing: element formats much
// narrower than C, as every preset's.) Under round to nearest that element is y's own rounding,
// so the check is left out there. The operations are those of a vectorisable loop: no float64 for
// the 16- and 32-bit containers, and no branches. kShortcut: the element grid takes the shortcuts
// of round.h (shortcut_applies), the same bits in fewer operations.
template <Rounding R, class C, bool kShortcut = false>
LPSIM_FN typename C::word float_scaled_element(typename C::word u,
                                               RealOf<ScaledArithmetic<C>> reciprocal,
                                               RealOf<ScaledArithmetic<C>> decode,
                                               const Grid<ScaledArithmetic<C>>& element,
                                               const Grid<ScaledArithmetic<C>>& own,
                                               uint32_t random, uint32_t mask) {
  using K = ScaledArithmetic<C>;
  const typename K::word x = to_arithmetic<C>(u);
  const auto y = bits_of_real(mul_rn(real_of(x), reciprocal));
  typename K::word out = decoded_element<C>(
      real_of(round_to_grid_or_shortcut<R, K, kShortcut>(y, element, random, mask)), decode, own);
  if constexpr (R != Rounding::nearest) {
    const typename K::word nearest = decoded_element<C>(
        real_of(round_to_grid_or_shortcut<Rounding::nearest, K, kShortcut>(y, element, 0, 0)),
        decode, own);
    out = select(nearest == x, x, out);
  }
  return from_arithmetic<C>(out);
}

// The value the element with bits u (container C) decodes to, in block scale b, rounded by rule R
// (random: the element's word; mask: random_mask(rbits)).
template <Rounding R, class C, bool kPowerOfTwo>
LPSIM_FN typename C::word scaled_element(typename C::word u, const BlockScale& b,
                                         const ElementGrids<C>& g, uint32_t random, uint32_t mask) {
  using K = ScaledArithmetic<C>;
  using T = RealOf<K>;
  using F64 = Float64Container;
  if (!b.finite) return C::quiet_nan;
  if constexpr (kPowerOfTwo) {
    Grid<C> shifted;
    if (shifted_element_grid<C>(g.container, b.exponent, shifted)) {
      return round_to_grid<R, C>(u, shifted, random, mask);
    }
    const double y = mul_rn(real_of(convert_exact<F64, C>(u)), pow2_double(-b.exponent));
    const T q =
        static_cast<T>(real_of(round_to_grid<R, F64>(bits_of_real(y), g.element, random, mask)));
    return convert_exact<C, K>(decoded_pow2_element<C>(q, b.exponent, g.own));
  } else {
    return float_scaled_element<R, C>(u, static_cast<T>(b.reciprocal), static_cast<T>(b.decode),
                                      g.arithmetic, g.own, random, mask);
  }
}

}  // namespace lpsim
