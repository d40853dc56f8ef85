// The lane loop of mac_matmul (see mac_lanes.h for the design).
// The vector types below are passed between inline functions only, never across a call, so the ABI
// of the baseline clone's 32-byte vectors (which gcc warns about) does not matter.
#pragma GCC diagnostic ignored "-Wpsabi"
#include "cpu/mac_lanes.h"

#include <lpsim/exact_sum.h>
#include <lpsim/mac.h>
#include <lpsim/nearest_sum.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "cpu/float64_operands.h"
#include "cpu/loops.h"
#include "dispatch.h"

namespace lpsim::cpu {
namespace {

using F64 = Float64Container;

// Tile size: 16 lanes by 4 rows is 16 AVX2 vectors of independent sums per term, to cover the
// latency of one addition's rounding (about 40 cycles on the fast path); the panel of b (K x 16
// float64) is read once per term for 4 rows. Measured against other sizes at nearest_terms.
constexpr int kLanes = 16;
constexpr int kRows = 4;
constexpr int kTileSize = kLanes * kRows;
// Terms whose random words are drawn ahead of the vector loop (stochastic rules): one Philox group
// (256 words) holds 32 terms' words of one result, of which the lanes use one or two per term.
constexpr int64_t kTermBlock = 32;

std::atomic<bool> lanes_enabled{true};

// One tile's operands in float64: a's rows (kRows x n, rows past the tile's own are zero) and the
// panel of b's columns (n x kLanes, columns past the tile's own are zero). A float64 product of two
// converted values is exact_product's (the core converts and multiplies the same way).
struct Tile {
  const double* a;
  const double* b;
  int64_t n;
};

// The tile's running sums over the terms [k0, k1) (k0 = 0 starts them), float64 bits, lane
// r * kLanes + l for row r and column l; `bad` marks lanes that met an Inf or NaN, which the caller
// redoes. `add_words` and `product_words` hold each lane's words of terms [k0, k1) (stochastic
// rules), term-major: word[(k - k0) * kTileSize + lane].
struct Lanes {
  alignas(64) uint64_t sum[kTileSize];
  alignas(64) uint64_t bad[kTileSize];
};

// The generic loop. gcc does not vectorise it (the core's float64-word arithmetic needs 64-bit
// operations AVX2 lacks: unsigned compares, int64 <-> double conversion), so it gains little on the
// scalar loop: measured 59 against 73 ns per multiply-add (bf16, rule up, one thread), and nothing
// for stochastic rules, whose cost is the random words (8 Philox words drawn per term).
template <Rounding R, bool kProduct, bool kTwoSum>
LPSIM_INLINE void generic_terms(const Tile& t, int64_t k0, int64_t k1, const Grid<F64>& acc_grid,
                                const Grid<F64>& product_grid, uint32_t mask,
                                const uint32_t* add_words, const uint32_t* product_words,
                                Lanes& lanes) {
  // Local copies: the stores to the lanes may alias the grids as far as the compiler knows.
  const Grid<F64> g = acc_grid, pg = product_grid;
  uint64_t* s = lanes.sum;
  uint64_t* bad = lanes.bad;
  auto word = [&](const uint32_t* words, int64_t k, int lane) LPSIM_LAMBDA_INLINE {
    return is_stochastic(R) ? words[(k - k0) * kTileSize + lane] : uint32_t(0);
  };
  auto term = [&](int64_t k, int r, int l) LPSIM_LAMBDA_INLINE {
    const uint64_t exact = bits_of_real(t.a[r * t.n + k] * t.b[k * kLanes + l]);
    if constexpr (kProduct) {
      return round_to_grid<R, F64>(exact, pg, word(product_words, k, r * kLanes + l), mask);
    } else {
      return exact;
    }
  };
  int64_t k = k0;
  if (k == 0) {
    for (int r = 0; r < kRows; ++r) {
      for (int l = 0; l < kLanes; ++l) {
        const int lane = r * kLanes + l;
        const uint64_t v = term(0, r, l);
        bad[lane] = has_special<F64>(v, v);
        s[lane] = round_to_grid<R, F64>(v, g, word(add_words, 0, lane), mask);
      }
    }
    ++k;
  }
  for (; k < k1; ++k) {
    for (int r = 0; r < kRows; ++r) {
      for (int l = 0; l < kLanes; ++l) {
        const int lane = r * kLanes + l;
        const uint64_t v = term(k, r, l);
        bad[lane] |= has_special<F64>(s[lane], v);
        const uint32_t random = word(add_words, k, lane);
        if constexpr (kTwoSum) {
          s[lane] = round_two_sum_to_grid<R>(s[lane], v, g, random, mask);
        } else {
          s[lane] = round_finite_sum_to_grid<R, F64>(s[lane], v, g, random, mask);
        }
      }
    }
  }
}

LPSIM_MULTIVERSION
void generic_kernel(Rounding rounding, bool has_product, bool two_sum, const Tile& t, int64_t k0,
                    int64_t k1, const Grid<F64>& acc_grid, const Grid<F64>& product_grid,
                    uint32_t mask, const uint32_t* add_words, const uint32_t* product_words,
                    Lanes& lanes) {
  with_rounding(rounding, [&](auto rule) LPSIM_LAMBDA_INLINE {
    constexpr Rounding R = decltype(rule)::value;
    auto run = [&](auto product, auto sum) LPSIM_LAMBDA_INLINE {
      generic_terms<R, decltype(product)::value, decltype(sum)::value>(
          t, k0, k1, acc_grid, product_grid, mask, add_words, product_words, lanes);
    };
    using Yes = std::true_type;
    using No = std::false_type;
    if (has_product) {
      two_sum ? run(Yes{}, Yes{}) : run(Yes{}, No{});
    } else {
      two_sum ? run(No{}, Yes{}) : run(No{}, No{});
    }
  });
}

// Nearest onto a grid that nearest_sum.h serves, exact products: every term of the tile, with
// nearest_sum on GCC vector types of four lanes. Measured on this 2-core Zen 3, one thread, bf16,
// 256x256x512, ns per multiply-add: the scalar form, which gcc does not vectorise across lanes,
// 7.3; these vectors 2.2 (kRows 2: 2.6; 8 lanes by 4 rows: 2.7). Tried and dropped: GCC's 8- and
// 16-lane vector types (12 and 7.5: gcc splits them badly), and a pack of four vectors whose
// operators interleave their instructions (2.4). The sum's ~23 operations, 11 of them on the two
// float64 adders, bound it near 0.7 ns at 2 GHz; the rest is latency the out-of-order core does not
// hide.
typedef double Doubles __attribute__((vector_size(32)));
typedef uint64_t Words __attribute__((vector_size(32)));
constexpr int kWidth = 4;  // lanes per vector
constexpr int kVectors = kLanes / kWidth;

// The vector forms' loop over a tile's terms [k0, k1): sum[r][v] = first(p, r, v) at term 0 (k0 = 0
// starts the sums; later blocks continue them) and sum[r][v] = add(sum[r][v], p, k, r, v) at every
// later term k, where p is the bits of the products of row r of a with the panel's v-th vector of
// columns (Values of the operands' type Real, as many lanes as fit). The forms differ only in
// first and add.
template <class Values, class Bits, class Real, int kCount, class First, class Add>
LPSIM_INLINE void vector_terms(const Real* a, const Real* b, int64_t n, int64_t k0, int64_t k1,
                               Bits (&sum)[kRows][kCount], First first, Add add) {
  constexpr int width = static_cast<int>(sizeof(Values) / sizeof(Real));
  static_assert(width * kCount == kLanes, "a row of the tile is kCount vectors");
  auto product = [&](int64_t k, int r, int v) LPSIM_LAMBDA_INLINE {
    Values column;
    __builtin_memcpy(&column, b + k * kLanes + v * width, sizeof column);
    const Values p = column * a[r * n + k];
    Bits u;
    __builtin_memcpy(&u, &p, sizeof u);
    return u;
  };
  int64_t k = k0;
  if (k == 0) {
    for (int r = 0; r < kRows; ++r) {
      for (int v = 0; v < kCount; ++v) sum[r][v] = first(product(0, r, v), r, v);
    }
    ++k;
  }
  for (; k < k1; ++k) {
    for (int r = 0; r < kRows; ++r) {
      for (int v = 0; v < kCount; ++v) sum[r][v] = add(sum[r][v], product(k, r, v), k, r, v);
    }
  }
}

template <bool kFlush>
LPSIM_INLINE bool nearest_terms(const Tile& t, const NearestGrid& grid, Lanes& lanes) {
  const NearestGrid g = grid;
  Words s[kRows][kVectors];
  Doubles top{};
  vector_terms<Doubles>(
      t.a, t.b, t.n, 0, t.n, s,
      [&](Words p, int, int)
          LPSIM_LAMBDA_INLINE { return nearest_round<Doubles, Words, kFlush>(p, g, top); },
      [&](Words sum, Words p, int64_t, int, int)
          LPSIM_LAMBDA_INLINE { return nearest_sum<Doubles, Words, kFlush>(sum, p, g, top); });
  __builtin_memcpy(lanes.sum, s, sizeof s);
  bool within = true;
  for (int j = 0; j < kWidth; ++j) within = within & (top[j] <= g.limit);
  return within;
}

// The tile's sums, or false where one of them overflows the grid (the caller then takes the
// generic loop). The operands must be finite.
LPSIM_MULTIVERSION
bool nearest_kernel(const Tile& t, const NearestGrid& g, Lanes& lanes) {
  return g.flush_threshold > 0 ? nearest_terms<true>(t, g, lanes)
                               : nearest_terms<false>(t, g, lanes);
}

// Nearest in float32 lanes (nearest_sum.h's nearest_bits_sum), for tiles whose products are all
// exact float32 values, onto grids with float32's exponent range: eight lanes to a vector, so a
// tile of 4 rows by 16 lanes is 8 vectors. Measured on a 2-core EPYC, one thread, bf16 accumulator
// and bf16 operands, 256x256x512, ns per multiply-add: the float64 vectors above 0.91, these 0.40
// (0.53 while they tracked the largest magnitude per term instead of reading Inf's bits from the
// final sums; a shift per lane for float16's grid gave 1.1, slower than the float64 vectors).
typedef float Floats __attribute__((vector_size(32)));
typedef uint32_t Words8 __attribute__((vector_size(32)));
constexpr int kFloatWidth = 8;
constexpr int kFloatVectors = kLanes / kFloatWidth;

// A tile's operands in float32, laid out as Tile's.
struct FloatTile {
  const float* a;
  const float* b;
  int64_t n;
};

// bfloat16's grid as a constant: its shift becomes an immediate operand, where the grid's shift
// (a variable) took a register that the 8 vectors of sums left free only by reloading it. One
// thread, bf16 operands and accumulator, 256x256x512, 12 alternated runs: 0.91x the time.
struct BFloat16Bits {
  static constexpr uint32_t shift = Float32Container::man_bits - 7;
};

// The tile's sums on grid g (a NearestBitsGrid, or BFloat16Bits), or false where one of them
// exceeds the grid's limit (the caller then takes the float64 paths).
template <class G>
LPSIM_INLINE bool float_terms(const FloatTile& t, const G& g, Lanes& lanes) {
  Words8 s[kRows][kFloatVectors];
  vector_terms<Floats>(
      t.a, t.b, t.n, 0, t.n, s,
      [&](Words8 p, int, int) LPSIM_LAMBDA_INLINE { return nearest_bits_round<Words8>(p, g); },
      [&](Words8 sum, Words8 p, int64_t, int, int)
          LPSIM_LAMBDA_INLINE { return nearest_bits_sum<Floats, Words8>(sum, p, g); });
  bool within = true;  // no sum went beyond the limit: none ends with an all-ones exponent field
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kFloatVectors; ++v) {
      for (int j = 0; j < kFloatWidth; ++j) {
        const uint32_t sum = s[r][v][j];
        within = within & ((sum & Float32Container::inf_bits) != Float32Container::inf_bits);
        lanes.sum[r * kLanes + v * kFloatWidth + j] = bits_of_real(double(real_of(sum)));
      }
    }
  }
  return within;
}

LPSIM_MULTIVERSION
bool nearest_float_kernel(const FloatTile& t, const NearestBitsGrid& grid, Lanes& lanes) {
  if (grid.shift == BFloat16Bits::shift) return float_terms(t, BFloat16Bits{}, lanes);
  const NearestBitsGrid g = grid;  // a local copy, as in round_span
  return float_terms(t, g, lanes);
}

// Stochastic rounding onto a grid make_stochastic_grid serves, exact products: the terms [k0, k1)
// of the tile (k0 = 0 starts the sums, later blocks continue them from lanes.sum), with the lanes'
// words in `words` (term-major, as generic_terms takes them) and stochastic_sum on the same
// vectors. `range` carries stochastic_sum's per-lane range from block to block; the caller checks
// it against the limit after the last block.
typedef int64_t Signed __attribute__((vector_size(32)));
typedef uint32_t Words32 __attribute__((vector_size(16)));

LPSIM_INLINE bool stochastic_terms(const Tile& t, int64_t k0, int64_t k1,
                                   const StochasticGrid& grid, const uint32_t* words, Lanes& lanes,
                                   Words* range) {
  const StochasticGrid g = grid;
  Words s[kRows][kVectors];
  Words r[kRows][kVectors];
  __builtin_memcpy(s, lanes.sum, sizeof s);
  __builtin_memcpy(r, range, sizeof r);
  auto word = [&](int64_t k, int row, int v) LPSIM_LAMBDA_INLINE {
    Words32 w;
    __builtin_memcpy(&w, words + (k - k0) * kTileSize + row * kLanes + v * kWidth, sizeof w);
    return __builtin_convertvector(w, Words);
  };
  vector_terms<Doubles>(
      t.a, t.b, t.n, k0, k1, s,
      [&](Words p, int row, int v) LPSIM_LAMBDA_INLINE {
        return stochastic_round<Words, Signed>(p, word(0, row, v), g, r[row][v]);
      },
      [&](Words sum, Words p, int64_t k, int row, int v) LPSIM_LAMBDA_INLINE {
        return stochastic_sum<Doubles, Words, Signed>(sum, p, word(k, row, v), g, r[row][v]);
      });
  __builtin_memcpy(lanes.sum, s, sizeof s);
  __builtin_memcpy(range, r, sizeof r);
  bool within = true;
  for (int row = 0; row < kRows; ++row) {
    for (int v = 0; v < kVectors; ++v) {
      for (int j = 0; j < kWidth; ++j) within = within & (r[row][v][j] <= g.limit);
    }
  }
  return within;
}

// stochastic_terms for one block; true while every lane's range is within the limit.
LPSIM_MULTIVERSION
bool stochastic_kernel(const Tile& t, int64_t k0, int64_t k1, const StochasticGrid& g,
                       const uint32_t* words, Lanes& lanes, Words* range) {
  return stochastic_terms(t, k0, k1, g, words, lanes, range);
}

// The operands' significant bits for the float32 lanes, over `count` float32 values: 0 where all
// are zeros, the widest significand's width where every nonzero magnitude is in [2^-62, 2^62), and
// kNoFloatTerms otherwise (an Inf, a NaN, a magnitude whose products could leave float32's normal
// range). Two sets whose widths add up to at most 24 have exact float32 products in
// [2^-124, 2^124) (or zeros). The widest significand has the fewest trailing zeros, so its width
// is read off the OR of all the fraction fields: reductions that vectorise.
constexpr int kNoFloatTerms = 64;
constexpr int kFloatTermBits = 24;

LPSIM_MULTIVERSION
int float_terms_width(const float* v, int64_t count) {
  using C = Float32Container;
  uint32_t fractions = 0, high = 0, low = 0xff;
  for (int64_t i = 0; i < count; ++i) {
    const uint32_t u = bits_of_real(v[i]) & C::abs_mask;
    const uint32_t field = u >> C::man_bits;
    fractions |= u & C::man_mask;
    high = std::max(high, field);
    low = std::min(low, u == 0 ? uint32_t(0xff) : field);
  }
  if (high == 0 && fractions == 0) return 0;  // zeros only
  if (low < 127 - 62 || high >= 127 + 62) return kNoFloatTerms;
  return 24 - __builtin_ctz(fractions | (uint32_t(1) << C::man_bits));
}

// The panel of b's columns [jb, jb + width) in the lanes' layout: panel[k * kLanes + l] =
// convert(column jb + l at term k), columns from width on zeros. b holds its columns' terms
// contiguously (n per column).
template <class T, class S, class Convert>
LPSIM_INLINE void pack_panel(const S* b, int64_t n, int64_t jb, int width, T* panel,
                             Convert convert) {
  for (int l = 0; l < kLanes; ++l) {
    const S* column = b + (jb + l) * n;
    for (int64_t k = 0; k < n; ++k) panel[k * kLanes + l] = l < width ? convert(column[k]) : T(0);
  }
}

// Whether this thread's float arithmetic keeps subnormals (the float32 lanes need it, see
// nearest_sum.h): torch.set_flush_denormal(True) sets flush-to-zero and denormals-are-zero.
inline bool keeps_subnormals() {
#if defined(__x86_64__)
  return (_mm_getcsr() & 0x8040u) == 0;  // FTZ (bit 15) and DAZ (bit 6) of MXCSR
#elif defined(__aarch64__)
  return (__builtin_aarch64_get_fpcr() & (1u << 24)) == 0;  // FZ of FPCR
#else
  return false;
#endif
}

std::atomic<int64_t> float_tiles{0};

// The scalar definition of result r (mac_span's loop), for the lanes marked bad.
template <class X, Rounding R>
uint64_t scalar_result(const typename X::storage* a, const typename X::storage* b, int64_t n,
                       int64_t p, int64_t r, const MacShape& shape, const Grid<F64>* product,
                       const Grid<F64>& acc, uint32_t mask, WordCache& words) {
  const typename X::storage* row = a + (r / p) * n;
  const typename X::storage* column = b + (r % p) * n;
  MacSum<R, WordCache> s(shape, product, acc, acc, mask, words, kMacWordsPerTerm * r * n);
  for (int64_t k = 0; k < n; ++k) {
    s.add(exact_product<X>(static_cast<typename X::word>(row[k]),
                           static_cast<typename X::word>(column[k])),
          k);
  }
  return s.finish(n);
}

template <class X, Rounding R>
void lanes_span(const void* av, const void* bv, uint64_t* y, int64_t n, int64_t p, int64_t begin,
                int64_t end, const MacShape& shape, const GridSpec* product, const GridSpec& acc,
                const RandomSpec& random) {
  using S = typename X::storage;
  const auto* a = static_cast<const S*>(av);
  const auto* b = static_cast<const S*>(bv);
  Grid<F64> acc_grid, product_grid;
  make_grid<F64>(acc, acc_grid);
  if (product != nullptr) make_grid<F64>(*product, product_grid);
  const Grid<F64>* product_ptr = product != nullptr ? &product_grid : nullptr;
  NearestGrid nearest{};
  const bool fast =
      R == Rounding::nearest && product == nullptr && make_nearest_grid(acc_grid, nearest);
  Grid<Float32Container> float_grid;
  NearestBitsGrid bits_grid{};
  const bool fast_float = fast && !std::is_same_v<X, F64> &&
                          make_grid<Float32Container>(acc, float_grid) == nullptr &&
                          make_nearest_bits_grid(float_grid, bits_grid) && keeps_subnormals();
  const bool two_sum = two_sum_serves(acc_grid, R);
  StochasticGrid stochastic{};
  const bool fast_stochastic =
      R == Rounding::stochastic && product == nullptr &&
      make_stochastic_grid(acc_grid, random_mask(random.rbits), stochastic);
  const PhiloxKey key = make_philox_key(random.seed, random.offset);
  WordCache cache(key);  // the scalar loop's, for the lanes it redoes
  // The lanes draw two of a term's kMacWordsPerTerm words at most: one Philox call in eight.
  StridedWordCache<kMacWordsPerTerm> add_cache(key), product_cache(key);
  const uint32_t mask = random_mask(random.rbits);

  std::vector<double> panels;
  std::vector<signed char> panel_finite;
  std::vector<double> rows(static_cast<size_t>(n) * kRows);
  // The same operands in float32 for the float32 lanes, with their widest operand's width.
  std::vector<float> float_panels;
  std::vector<int> panel_width;
  std::vector<float> float_rows(fast_float ? static_cast<size_t>(n) * kRows : 0);
  const int64_t block = is_stochastic(R) ? kTermBlock : n;
  std::vector<uint32_t> add_words, product_words;
  if (is_stochastic(R)) {
    add_words.resize(static_cast<size_t>(block) * kTileSize);
    product_words.resize(static_cast<size_t>(block) * kTileSize);
  }
  Lanes lanes;

  // The results of rows [i0, i1) and columns [j0, j1).
  auto results = [&](int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
    // b's columns [j0, j1) as panels of kLanes columns, packed once for all the row blocks (per
    // multiply-add, converting operands per tile cost about as much as the fast path's arithmetic):
    // in float32 for the float32 lanes, with their width, and in float64 where a tile takes the
    // other paths, packed at its first use (the float32 lanes serve most tiles without them).
    const int64_t blocks = (j1 - j0 + kLanes - 1) / kLanes;
    const int64_t panel_size = n * kLanes;
    panel_finite.assign(static_cast<size_t>(blocks), -1);  // -1: not packed yet
    auto double_panel = [&](int64_t block_index) {
      // Allocated at the first tile that needs one (a pointer into it lives for one tile).
      if (panels.size() < static_cast<size_t>(blocks * panel_size)) {
        panels.resize(static_cast<size_t>(blocks * panel_size));
      }
      double* panel = panels.data() + block_index * panel_size;
      if (panel_finite[block_index] < 0) {
        const int64_t jb = j0 + block_index * kLanes;
        const int width = static_cast<int>(std::min<int64_t>(kLanes, j1 - jb));
        pack_panel(b, n, jb, width, panel, [](S v) { return as_double<X>(v); });
        bool finite = true;  // the fast path takes finite operands only
        for (int64_t i = 0; i < panel_size; ++i) finite = finite & (panel[i] - panel[i] == 0.0);
        panel_finite[block_index] = finite;
      }
      return panel;
    };
    if (fast_float) {
      float_panels.resize(static_cast<size_t>(blocks * panel_size));
      panel_width.assign(static_cast<size_t>(blocks), 0);
      for (int64_t block_index = 0; block_index < blocks; ++block_index) {
        const int64_t jb = j0 + block_index * kLanes;
        const int width = static_cast<int>(std::min<int64_t>(kLanes, j1 - jb));
        float* panel = float_panels.data() + block_index * panel_size;
        pack_panel(b, n, jb, width, panel, [](S v) { return static_cast<float>(as_double<X>(v)); });
        panel_width[block_index] = float_terms_width(panel, panel_size);
      }
    }
    for (int64_t ib = i0; ib < i1; ib += kRows) {
      const int height = static_cast<int>(std::min<int64_t>(kRows, i1 - ib));
      bool rows_finite = true;
      for (int r = 0; r < kRows; ++r) {
        const S* row = a + (ib + r) * n;
        for (int64_t k = 0; k < n; ++k) {
          const double v = r < height ? as_double<X>(row[k]) : 0.0;
          rows[r * n + k] = v;
          rows_finite = rows_finite & (v - v == 0.0);
        }
      }
      int rows_width = kNoFloatTerms;
      if (fast_float) {
        for (int64_t i = 0; i < kRows * n; ++i) float_rows[i] = static_cast<float>(rows[i]);
        rows_width = float_terms_width(float_rows.data(), kRows * n);
      }
      for (int64_t block_index = 0; block_index < blocks; ++block_index) {
        const int64_t jb = j0 + block_index * kLanes;
        const int width = static_cast<int>(std::min<int64_t>(kLanes, j1 - jb));
        // The words of terms [k0, k1) of the tile's lanes, lane-major, so that the caches generate
        // each result's groups once.
        auto gather_words = [&](int64_t k0, int64_t k1) {
          for (int r = 0; r < height; ++r) {
            for (int l = 0; l < width; ++l) {
              const int lane = r * kLanes + l;
              const int64_t first = kMacWordsPerTerm * (((ib + r) * p + jb + l) * n + k0);
              for (int64_t k = k0; k < k1; ++k) {
                const int64_t w = first + kMacWordsPerTerm * (k - k0);
                add_words[(k - k0) * kTileSize + lane] = add_cache(w + kAddWord);
                if (product != nullptr) {
                  product_words[(k - k0) * kTileSize + lane] = product_cache(w + kProductWord);
                }
              }
            }
          }
        };
        // Stochastic rounding in vectors: every block, then one check of the range.
        auto stochastic_tile = [&](const Tile& tile) {
          Words range[kRows * kVectors] = {};
          bool within = true;
          for (int64_t k0 = 0; k0 < n; k0 += block) {
            const int64_t k1 = std::min(n, k0 + block);
            gather_words(k0, k1);
            within = stochastic_kernel(tile, k0, k1, stochastic, add_words.data(), lanes, range);
          }
          return within;
        };
        // The float32 lanes where every product is an exact float32 value, else the float64 ones.
        auto float_tile = [&]() {
          const FloatTile ft{float_rows.data(), float_panels.data() + block_index * panel_size, n};
          if (!nearest_float_kernel(ft, bits_grid, lanes)) return false;
          float_tiles.fetch_add(1, std::memory_order_relaxed);
          return true;
        };
        const bool float_terms =
            fast_float && rows_width + panel_width[block_index] <= kFloatTermBits;
        bool done = float_terms && float_tile();
        if (!done) {
          const Tile tile{rows.data(), double_panel(block_index), n};
          const bool finite = rows_finite && panel_finite[block_index] == 1;
          done = (fast && finite && nearest_kernel(tile, nearest, lanes)) ||
                 (fast_stochastic && finite && stochastic_tile(tile));
          if (!done) {
            for (int64_t k0 = 0; k0 < n; k0 += block) {
              const int64_t k1 = std::min(n, k0 + block);
              if constexpr (is_stochastic(R)) gather_words(k0, k1);
              generic_kernel(R, product != nullptr, two_sum, tile, k0, k1, acc_grid, product_grid,
                             mask, add_words.data(), product_words.data(), lanes);
            }
          }
        }
        if (done) std::fill(lanes.bad, lanes.bad + kTileSize, uint64_t(0));
        for (int r = 0; r < height; ++r) {
          for (int l = 0; l < width; ++l) {
            const int lane = r * kLanes + l;
            const int64_t result = (ib + r) * p + jb + l;
            y[result] = lanes.bad[lane] != 0
                            ? scalar_result<X, R>(a, b, n, p, result, shape, product_ptr, acc_grid,
                                                  mask, cache)
                            : lanes.sum[lane];
          }
        }
      }
    }
  };

  // The task's results in row-major order: a partial first row, whole rows, a partial last row.
  const int64_t first_row = begin / p, last_row = (end - 1) / p;
  if (first_row == last_row) {
    results(first_row, first_row + 1, begin % p, (end - 1) % p + 1);
    return;
  }
  int64_t whole = first_row;
  if (begin % p != 0) {
    results(first_row, first_row + 1, begin % p, p);
    ++whole;
  }
  const int64_t stop = end % p == 0 ? last_row + 1 : last_row;
  if (stop > whole) results(whole, stop, 0, p);
  if (end % p != 0) results(last_row, last_row + 1, 0, end % p);
}

}  // namespace

bool mac_matmul_lanes(Dtype x_dtype, Rounding rounding, const void* a, const void* b, uint64_t* y,
                      int64_t n, int64_t p, int64_t begin, int64_t end, const MacShape& shape,
                      const GridSpec* product, const GridSpec& acc, const RandomSpec& random) {
  if (!lanes_enabled.load(std::memory_order_relaxed) || shape.order != MacOrder::kSequential ||
      shape.compensated || shape.tensor_core.group != 0 || n == 0 || end <= begin ||
      x_dtype == Dtype::float64) {
    return false;
  }
  with_container(x_dtype, [&](auto cx) {
    using X = decltype(cx);
    if constexpr (!std::is_same_v<X, F64>) {
      with_rounding(rounding, [&](auto rule) {
        lanes_span<X, decltype(rule)::value>(a, b, y, n, p, begin, end, shape, product, acc,
                                             random);
      });
    }
  });
  return true;
}

bool set_mac_lanes(bool enabled) { return lanes_enabled.exchange(enabled); }
int64_t mac_float_tiles() { return float_tiles.load(std::memory_order_relaxed); }
bool mac_lanes_enabled() { return lanes_enabled.load(std::memory_order_relaxed); }

}  // namespace lpsim::cpu
