// CPU loops of the scaled-format ops (see scaled.h), multiversioned for AVX2 (loops.h).
//
// The loops choose, block by block, how to compute what scaled.h defines, and define nothing
// themselves:
// - a power-of-two scale whose shifted element grid fits the container (shifted_element_grid)
//   rounds x onto that grid in the container, as quantize.cpp's round_span rounds onto a format's
//   grid: the same vectorised loop over round_to_grid;
// - where it fits only float32 (16-bit containers: small blocks in float16, all-zero blocks in
//   bfloat16), x is rounded onto the shifted grid in float32 (shifted_arithmetic_element);
// - any other power-of-two block (tiny blocks) runs scaled_element one element at a time, out of
//   line (slow_loop);
// - a Float scale runs float_scaled_element, vectorised in the arithmetic's container;
// - a block that holds a NaN or an Inf is NaN throughout.
//
// Elements are rounded a batch at a time: at most kBatch consecutive elements of memory, cut into
// pieces of one block each, with their random words in an array beside them (BatchRounder). A
// batch is one or more whole small blocks along the last axis (MX's 32, NVFP4's 16), a stretch of
// one larger block (rows, tiles, the whole tensor), or, for blocks along another axis (inner > 1:
// consecutive elements in different blocks), a sub-tile of a group transposed into a buffer so that
// each block's elements are consecutive. Neighbouring pieces with one power-of-two scale are
// rounded as one run on one grid, and each element of a batch with Float scales has its block's
// factors in arrays, so a batch is a few long loops, not one short loop per block.
#include "cpu/scaled.h"

#include <lpsim/philox.h>
#include <lpsim/round.h>
#include <lpsim/scaled.h>
#include <lpsim/scaled_statistics.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/loops.h"
#include "cpu/round_span.h"
#include "dispatch.h"

namespace lpsim::cpu {

namespace {

// Elements per batch: they, their words and their factors stay in L1.
constexpr int64_t kBatch = 2048;
// Groups of one block of at most this many elements along the last axis are taken several at a
// time into a batch.
constexpr int64_t kSmallBlock = 256;

// The tiles of consecutive groups, without group_tile's divisions for each group.
class TileCursor {
 public:
  TileCursor(const ScaledLayout& l, int64_t g)
      : l_(l), across_(l.tiles_across()), down_(l.tiles_down()) {
    tc_ = g % across_;
    tr_ = (g / across_) % down_;
    o_ = g / (across_ * down_);
  }
  GroupTile tile() const { return tile_at(l_, o_, tr_, tc_); }
  void next() {
    if (++tc_ < across_) return;
    tc_ = 0;
    if (++tr_ < down_) return;
    tr_ = 0;
    ++o_;
  }

 private:
  const ScaledLayout& l_;
  int64_t across_, down_;
  int64_t o_, tr_, tc_;
};

// f(first, n) for each contiguous run of elements of positions [p0, p1) of tile t, inner indices
// [i0, i1): a run starts at offset `first` with inner index i0 and holds n elements, a multiple of
// i1 - i0 (whole positions).
template <class F>
LPSIM_INLINE void for_each_run(const ScaledLayout& l, const GroupTile& t, int64_t p0, int64_t p1,
                               int64_t i0, int64_t i1, F&& f) {
  const int64_t positions = std::min(p1, t.height * t.width);
  if (p0 >= positions) return;
  int64_t row = p0 == 0 ? 0 : p0 / t.width;
  int64_t column = p0 == 0 ? 0 : p0 % t.width;
  if (i1 - i0 == l.inner) {
    // All inner indices: a tile row's positions are contiguous.
    for (int64_t p = p0; p < positions; ++row, column = 0) {
      const int64_t count = std::min(t.width - column, positions - p);
      f(t.start + (row * l.cols + column) * l.inner, count * l.inner);
      p += count;
    }
  } else {
    for (int64_t p = p0; p < positions; ++p) {
      f(t.start + (row * l.cols + column) * l.inner + i0, i1 - i0);
      if (++column == t.width) {
        column = 0;
        ++row;
      }
    }
  }
}

template <class C>
LPSIM_INLINE typename C::word magnitude(typename C::storage s) {
  return static_cast<typename C::word>(s) & C::abs_mask;
}

// The largest magnitude bits of x[first, first + n), at least m.
template <class C>
LPSIM_INLINE typename C::word max_abs_of(const typename C::storage* x, int64_t first, int64_t n,
                                         typename C::word m) {
  for (int64_t k = first; k < first + n; ++k) m = max_of(m, magnitude<C>(x[k]));
  return m;
}

// amax[j] = the running maximum of the magnitude bits of element j of each row of `width`
// elements of x[first, first + n).
template <class C>
LPSIM_INLINE void max_abs_rows(const typename C::storage* x, int64_t first, int64_t n,
                               int64_t width, typename C::word* amax) {
  for (int64_t row = first; row < first + n; row += width) {
    for (int64_t j = 0; j < width; ++j) amax[j] = max_of(amax[j], magnitude<C>(x[row + j]));
  }
}

// words[k] = the random word of element first + k of the tensor, for k in [0, n).
LPSIM_INLINE void copy_words(WordCache& cache, int64_t first, int64_t n, uint32_t* words) {
  for (int64_t k = 0; k < n;) {
    const int64_t group = (first + k) / kGroupSize;
    const int64_t start = first + k - group * kGroupSize;  // within the group
    const int64_t count = std::min(n - k, kGroupSize - start);
    std::memcpy(words + k, cache.group(group) + start, static_cast<size_t>(count) * 4);
    k += count;
  }
}

// ---- The loops over the elements of a batch: y[k] from x[k] and words[k] for k in [0, n). These
// are the only code instantiated for each rounding rule.

template <bool kStochastic>
LPSIM_INLINE uint32_t word_at(const uint32_t* words, int64_t k) {
  if constexpr (kStochastic) {
    return words[k];
  } else {
    return 0;
  }
}

// On one grid (a power-of-two block whose shifted grid fits), as quantize.cpp's round_span: round
// to nearest and stochastic rounding by the forms of lpsim/in_range.h where the grid's `range`
// (nullptr: none) and each block allow, else by the shortcuts where the grid takes them.
template <Rounding R, class C>
LPSIM_INLINE void round_on_grid_loop(const typename C::storage* x, typename C::storage* y,
                                     const uint32_t* words, int64_t n, const Grid<C>& grid,
                                     const InRange<C>* range, uint32_t mask) {
  using S = typename C::storage;
  const Grid<C> g = grid;  // a local copy, as in round_span
  if constexpr (R == Rounding::nearest || R == Rounding::stochastic) {
    if (shortcut_applies(g)) {
      const InRange<C> r = range != nullptr ? *range : InRange<C>{};
      round_by_forms<C, R>(x, y, words, n, g, range != nullptr, r, mask);
      return;
    }
  }
  for (int64_t k = 0; k < n; ++k) {
    y[k] = static_cast<S>(round_to_grid<R, C>(x[k], g, word_at<is_stochastic(R)>(words, k), mask));
  }
}

// On one grid in the arithmetic's container (a power-of-two block of a 16-bit container whose
// shifted grid fits only float32).
template <Rounding R, class C>
LPSIM_INLINE void round_on_arithmetic_grid_loop(const typename C::storage* x,
                                                typename C::storage* y, const uint32_t* words,
                                                int64_t n, const Grid<ScaledArithmetic<C>>& grid,
                                                const ElementGrids<C>& grids, uint32_t mask) {
  using S = typename C::storage;
  using K = ScaledArithmetic<C>;
  const Grid<K> g = grid, own = grids.own;  // local copies, as in round_span
  for (int64_t k = 0; k < n; ++k) {
    y[k] = static_cast<S>(
        shifted_arithmetic_element<R, C>(x[k], g, own, word_at<is_stochastic(R)>(words, k), mask));
  }
}

// With Float scales, element k's block's factors r[k] and d[k]; kShortcut as float_scaled_element.
template <Rounding R, class C, bool kShortcut>
LPSIM_INLINE void float_scaled_loop(const typename C::storage* x, typename C::storage* y,
                                    const uint32_t* words, int64_t n,
                                    const RealOf<ScaledArithmetic<C>>* r,
                                    const RealOf<ScaledArithmetic<C>>* d,
                                    const ElementGrids<C>& grids, uint32_t mask) {
  using S = typename C::storage;
  using K = ScaledArithmetic<C>;
  const Grid<K> element = grids.arithmetic, own = grids.own;  // local copies, as in round_span
  for (int64_t k = 0; k < n; ++k) {
    y[k] = static_cast<S>(float_scaled_element<R, C, kShortcut>(
        x[k], r[k], d[k], element, own, word_at<is_stochastic(R)>(words, k), mask));
  }
}

// scaled_element for the elements of blocks that take no vectorised path, out of line: they are
// rare (tiny blocks, with scales below 2^-127 or elements finer than float32's), and scalar
// float64 arithmetic in any case, so one copy for all instruction sets keeps the loops small.
template <Rounding R, class C>
__attribute__((noinline)) void slow_loop(const typename C::storage* x, typename C::storage* y,
                                         const uint32_t* words, int64_t n, const BlockScale& b,
                                         const ElementGrids<C>& grids, uint32_t mask) {
  using S = typename C::storage;
  for (int64_t k = 0; k < n; ++k) {
    y[k] = static_cast<S>(
        scaled_element<R, C, true>(x[k], b, grids, word_at<is_stochastic(R)>(words, k), mask));
  }
}

// ---- Batches

// Consecutive elements of a batch in one block.
struct Piece {
  int64_t size;
  int64_t block;  // index into the batch rounder's scales
};

template <class C>
class BatchRounder {
 public:
  using S = typename C::storage;
  using W = typename C::word;
  using K = ScaledArithmetic<C>;
  using T = RealOf<K>;

  // Scales for at most `blocks` blocks at a time.
  BatchRounder(const ScaledSpec& spec, const RandomSpec& random, int64_t blocks)
      : spec_(spec),
        grids_(element_grids<C>(spec)),
        mask_(random_mask(random.rbits)),
        scale_(static_cast<size_t>(blocks)),
        block_finite_(static_cast<size_t>(blocks)),
        block_reciprocal_(static_cast<size_t>(blocks)),
        block_decode_(static_cast<size_t>(blocks)),
        reciprocal_(static_cast<size_t>(kBatch)),
        decode_(static_cast<size_t>(kBatch)) {
    if (spec.rule == ScaleRule::amax) {
      make_grid(spec.scale, scale_grid_);  // validated by the op
    } else {
      // The exponents block_scale gives.
      exponent_min_ = static_cast<int32_t>(spec.scale.emin);
      const int32_t exponent_max = floor_log2(bits_of_real(spec.scale.pos_limit));
      shifted_state_.assign(static_cast<size_t>(exponent_max - exponent_min_ + 1), kUnknown);
      shifted_.resize(shifted_state_.size());
      shifted_ranges_.resize(shifted_state_.size());
      shifted_ranged_.assign(shifted_state_.size(), 0);
      shifted_arithmetic_.resize(shifted_state_.size());
      runs_.reserve(static_cast<size_t>(kBatch));
    }
  }

  // The scales of blocks [0, count), from their largest magnitude bits or given.
  LPSIM_INLINE void set_scales(const W* amax, int64_t count) {
    if (spec_.rule != ScaleRule::amax) {
      for (int64_t j = 0; j < count; ++j) scale_[j] = block_scale<C>(amax[j], spec_, scale_grid_);
      return;
    }
    // Float scales as block_scale computes them, in loops that vectorise (local copies, as in
    // round_span).
    const ScaledSpec spec = spec_;
    const Grid<K> scale_grid = scale_grid_;
    T* r = block_reciprocal_.data();
    T* d = block_decode_.data();
    uint8_t* finite = block_finite_.data();
    for (int64_t j = 0; j < count; ++j) {
      float_scale_factors<C>(amax[j], spec, scale_grid, r[j], d[j]);
    }
    for (int64_t j = 0; j < count; ++j) finite[j] = finite_block<C>(amax[j], spec);
  }
  LPSIM_INLINE void set_scales(const BlockScale* scales, int64_t count) {
    if (spec_.rule != ScaleRule::amax) {
      std::copy(scales, scales + count, scale_.begin());
      return;
    }
    for (int64_t j = 0; j < count; ++j) {
      block_finite_[j] = scales[j].finite;
      block_reciprocal_[j] = static_cast<T>(scales[j].reciprocal);
      block_decode_[j] = static_cast<T>(scales[j].decode);
    }
  }

  // x[0, n) rounded into y[0, n) by `rounding`: the pieces [0, count) in order (their sizes sum to
  // n <= kBatch), words[k] the random word of element k (read by the stochastic rules only).
  // x and y may be the same memory. The loops of every rule are here, once: multiversioned itself
  // (loops.h) and called by the entry point's drivers wherever they have a batch.
  LPSIM_MULTIVERSION __attribute__((noinline)) void round(Rounding rounding, const S* x, S* y,
                                                          const uint32_t* words,
                                                          const Piece* pieces, int64_t count) {
    if (spec_.rule != ScaleRule::amax) {
      plan_runs(pieces, count);
      with_rounding(rounding, [&](auto tag) LPSIM_LAMBDA_INLINE {
        constexpr Rounding R = decltype(tag)::value;
        for (const Run& run : runs_) {
          const S* xs = x + run.start;
          S* ys = y + run.start;
          const uint32_t* ws = words + run.start;
          if (run.grid != nullptr) {
            round_on_grid_loop<R, C>(xs, ys, ws, run.n, *run.grid, run.range, mask_);
          } else if (run.arithmetic_grid != nullptr) {
            if constexpr (!std::is_same_v<K, C>) {
              round_on_arithmetic_grid_loop<R, C>(xs, ys, ws, run.n, *run.arithmetic_grid, grids_,
                                                  mask_);
            }
          } else {
            slow_loop<R, C>(xs, ys, ws, run.n, scale_[run.block], grids_, mask_);
          }
        }
      });
      return;
    }
    int64_t n = 0;
    bool any_nan = false;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t j = pieces[i].block;
      std::fill_n(reciprocal_.begin() + n, pieces[i].size, block_reciprocal_[j]);
      std::fill_n(decode_.begin() + n, pieces[i].size, block_decode_[j]);
      any_nan = any_nan || block_finite_[j] == 0;
      n += pieces[i].size;
    }
    with_rounding(rounding, [&](auto tag) LPSIM_LAMBDA_INLINE {
      constexpr Rounding R = decltype(tag)::value;
      with_flag(shortcut_applies(grids_.arithmetic), [&](auto shortcut) LPSIM_LAMBDA_INLINE {
        float_scaled_loop<R, C, decltype(shortcut)::value>(x, y, words, n, reciprocal_.data(),
                                                           decode_.data(), grids_, mask_);
      });
    });
    // A block with a NaN or an Inf is NaN whatever its elements: written over the loop's values.
    if (!any_nan) return;
    for (int64_t i = 0, start = 0; i < count; start += pieces[i++].size) {
      if (block_finite_[pieces[i].block] == 0) {
        std::fill_n(y + start, pieces[i].size, static_cast<S>(C::quiet_nan));
      }
    }
  }

 private:
  // Elements [start, start + n) of a batch with power-of-two scales: on `grid` in C, or else on
  // `arithmetic_grid` in the arithmetic's container, or else (both nullptr) by scaled_element in
  // block `block`.
  struct Run {
    int64_t start, n;
    const Grid<C>* grid;
    const InRange<C>* range;  // grid's ranges of lpsim/in_range.h, or nullptr
    const Grid<K>* arithmetic_grid;
    int64_t block;
  };

  // Sets the element grid shifted by exponent e in C, or where it does not fit C, in the
  // arithmetic's container (16-bit containers only; float32 and float64 are their own), or
  // neither: built once per call for each exponent that occurs.
  void set_shifted_grids(int32_t e, Run& run) {
    const auto i = static_cast<size_t>(e - exponent_min_);
    if (shifted_state_[i] == kUnknown) {
      if (shifted_element_grid<C>(grids_.container, e, shifted_[i])) {
        shifted_state_[i] = kFits;
        shifted_ranged_[i] = make_in_range(shifted_[i], shifted_ranges_[i]);
      } else if (!std::is_same_v<K, C> &&
                 shifted_element_grid<K>(grids_.arithmetic, e, shifted_arithmetic_[i])) {
        shifted_state_[i] = kFitsArithmetic;
      } else {
        shifted_state_[i] = kDoesNotFit;
      }
    }
    run.grid = shifted_state_[i] == kFits ? &shifted_[i] : nullptr;
    run.range = shifted_state_[i] == kFits && shifted_ranged_[i] ? &shifted_ranges_[i] : nullptr;
    run.arithmetic_grid = shifted_state_[i] == kFitsArithmetic ? &shifted_arithmetic_[i] : nullptr;
  }

  // The runs of a batch: neighbouring pieces with one exponent share one grid.
  void plan_runs(const Piece* pieces, int64_t count) {
    runs_.clear();
    for (int64_t i = 0, start = 0; i < count;) {
      const BlockScale& b = scale_[pieces[i].block];
      Run run;
      run.start = start;
      run.n = pieces[i].size;
      run.block = pieces[i].block;
      for (++i; i < count && b.finite; ++i) {
        const BlockScale& next = scale_[pieces[i].block];
        if (!next.finite || next.exponent != b.exponent) break;
        run.n += pieces[i].size;
      }
      run.grid = nullptr;
      run.range = nullptr;
      run.arithmetic_grid = nullptr;
      if (b.finite) set_shifted_grids(b.exponent, run);
      runs_.push_back(run);
      start += run.n;
    }
  }

  const ScaledSpec& spec_;
  const ElementGrids<C> grids_;
  Grid<K> scale_grid_{};  // Float scales only
  const uint32_t mask_;
  std::vector<BlockScale> scale_;  // power-of-two scales
  // Float scales: whether block j is finite, and its factors.
  std::vector<uint8_t> block_finite_;
  std::vector<T> block_reciprocal_, block_decode_;
  // Power-of-two scales: a batch's runs, and the shifted grids of the exponents in
  // [exponent_min_, the scale's largest].
  std::vector<Run> runs_;
  int32_t exponent_min_ = 0;
  enum : uint8_t { kUnknown, kFits, kFitsArithmetic, kDoesNotFit };
  std::vector<uint8_t> shifted_state_;
  std::vector<Grid<C>> shifted_;
  std::vector<InRange<C>> shifted_ranges_;
  std::vector<uint8_t> shifted_ranged_;
  std::vector<Grid<K>> shifted_arithmetic_;
  std::vector<T> reciprocal_, decode_;  // Float scales: each element's block's factors
};

// ---- The tasks

// What a thread needs for its tasks: the rounder, its random words, and buffers.
template <class C>
struct TaskState {
  using S = typename C::storage;
  using W = typename C::word;

  BatchRounder<C> rounder;
  WordCache cache;
  bool stochastic;
  std::vector<uint32_t> words;  // kBatch
  std::vector<Piece> pieces;    // kBatch
  std::vector<W> amax;          // a task's blocks
  // Blocks along another axis (inner > 1): a task's rows and their words, and a transposed
  // sub-tile of at most kBatch elements.
  std::vector<int64_t> rows;
  std::vector<uint32_t> row_words;
  std::vector<S> x, y;

  TaskState(Rounding rounding, const ScaledSpec& spec, const RandomSpec& random, int64_t blocks)
      : rounder(spec, random, std::max(blocks, kBatch)),
        cache(make_philox_key(random.seed, random.offset)),
        stochastic(is_stochastic(rounding)),
        words(static_cast<size_t>(kBatch)),
        pieces(static_cast<size_t>(kBatch)),
        amax(static_cast<size_t>(std::max(blocks, kBatch))) {}
};

// Small blocks along the last axis: the tasks [begin, end) are groups of one block each, which
// lie one after the other in memory; a batch takes as many as fit.
template <class C>
LPSIM_INLINE void small_blocks(TaskState<C>& s, Rounding rounding, const typename C::storage* x,
                               typename C::storage* y, const ScaledLayout& l, int64_t begin,
                               int64_t end) {
  using W = typename C::word;
  TileCursor cursor(l, begin);
  GroupTile t = cursor.tile();
  for (int64_t task = begin; task < end;) {
    const int64_t first = t.start;
    int64_t count = 0, n = 0;
    do {
      s.pieces[count] = Piece{t.width, count};
      s.amax[count] = max_abs_of<C>(x, t.start, t.width, W(0));
      n += t.width;
      ++count;
      ++task;
      cursor.next();
      t = cursor.tile();
    } while (task < end && n + t.width <= kBatch);
    s.rounder.set_scales(s.amax.data(), count);
    if (s.stochastic) copy_words(s.cache, first, n, s.words.data());
    s.rounder.round(rounding, x + first, y + first, s.words.data(), s.pieces.data(), count);
  }
}

// The positions [p0, p1) of tile t, inner indices [i0, i1), with the scales of blocks [0, i1 - i0)
// set.
template <class C>
LPSIM_INLINE void round_group(TaskState<C>& s, Rounding rounding, const typename C::storage* x,
                              typename C::storage* y, const ScaledLayout& l, const GroupTile& t,
                              int64_t p0, int64_t p1, int64_t i0, int64_t i1) {
  const int64_t width = i1 - i0;
  if (width == l.inner && width == 1) {
    // Runs of consecutive elements of block 0.
    for_each_run(l, t, p0, p1, i0, i1, [&](int64_t first, int64_t n) LPSIM_LAMBDA_INLINE {
      for (int64_t start = first; start < first + n; start += kBatch) {
        const int64_t size = std::min(kBatch, first + n - start);
        s.pieces[0] = Piece{size, 0};
        if (s.stochastic) copy_words(s.cache, start, size, s.words.data());
        s.rounder.round(rounding, x + start, y + start, s.words.data(), s.pieces.data(), 1);
      }
    });
    return;
  }
  // Rows of `width` elements, element j in block j: sub-tiles of up to `height_max` rows and
  // `across` columns are transposed into a buffer (column j's elements consecutive: one piece per
  // block), rounded, and put back. Tall sub-tiles make long pieces.
  s.rows.clear();
  for_each_run(l, t, p0, p1, i0, i1, [&](int64_t first, int64_t n) LPSIM_LAMBDA_INLINE {
    for (int64_t row = first; row < first + n; row += width) s.rows.push_back(row);
  });
  const int64_t rows = static_cast<int64_t>(s.rows.size());
  if (rows == 0) return;  // a chunk past the end of a smaller tile
  if (s.stochastic) {
    // The words of all the rows, in order: each group of words is generated once.
    s.row_words.resize(static_cast<size_t>(rows * width));
    for (int64_t r = 0; r < rows; ++r) {
      copy_words(s.cache, s.rows[r], width, s.row_words.data() + r * width);
    }
  }
  const int64_t height_max = std::min(rows, kBatch);
  const int64_t across = std::clamp<int64_t>(kBatch / height_max, 1, width);
  for (int64_t r0 = 0; r0 < rows; r0 += height_max) {
    const int64_t height = std::min(height_max, rows - r0);
    const int64_t* row = s.rows.data() + r0;
    for (int64_t c0 = 0; c0 < width; c0 += across) {
      const int64_t columns = std::min(across, width - c0);
      for (int64_t r = 0; r < height; ++r) {
        for (int64_t j = 0; j < columns; ++j) s.x[j * height + r] = x[row[r] + c0 + j];
      }
      if (s.stochastic) {
        const uint32_t* row_words = s.row_words.data() + r0 * width + c0;
        for (int64_t r = 0; r < height; ++r) {
          for (int64_t j = 0; j < columns; ++j) s.words[j * height + r] = row_words[r * width + j];
        }
      }
      for (int64_t j = 0; j < columns; ++j) s.pieces[j] = Piece{height, c0 + j};
      s.rounder.round(rounding, s.x.data(), s.y.data(), s.words.data(), s.pieces.data(), columns);
      for (int64_t r = 0; r < height; ++r) {
        for (int64_t j = 0; j < columns; ++j) y[row[r] + c0 + j] = s.y[j * height + r];
      }
    }
  }
}

template <class C>
LPSIM_INLINE void tasks_impl(Rounding rounding, const void* x, void* y, const ScaledLayout& l,
                             const ScaledTasks& tasks, int64_t begin, int64_t end,
                             const ScaledSpec& spec, const RandomSpec& random,
                             const BlockScale* scales) {
  using S = typename C::storage;
  using W = typename C::word;
  const auto* xs = static_cast<const S*>(x);
  auto* ys = static_cast<S*>(y);
  TaskState<C> s(rounding, spec, random, tasks.width);
  // Groups of one row of at most kSmallBlock elements, each one block, follow one another.
  if (scales == nullptr && l.inner == 1 && (l.tile_rows == 1 || l.rows == 1) &&
      l.tile_cols <= kSmallBlock) {
    return small_blocks<C>(s, rounding, xs, ys, l, begin, end);
  }
  if (l.inner > 1) {
    s.x.resize(static_cast<size_t>(kBatch));
    s.y.resize(static_cast<size_t>(kBatch));
  }
  // Task `begin`'s group, slice and chunk, then the next task's, without divisions.
  const int64_t per_group = tasks.slices * tasks.chunks;
  TileCursor cursor(l, begin / per_group);
  int64_t group = begin / per_group;
  int64_t slice = begin / tasks.chunks % tasks.slices;
  int64_t chunk = begin % tasks.chunks;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t i0 = slice * tasks.width, i1 = std::min(l.inner, i0 + tasks.width);
    const int64_t p0 = chunk * tasks.chunk, p1 = p0 + tasks.chunk;
    const GroupTile t = cursor.tile();
    if (scales != nullptr) {
      s.rounder.set_scales(scales + group * l.inner + i0, i1 - i0);
    } else {
      std::fill(s.amax.begin(), s.amax.begin() + (i1 - i0), W(0));
      for_each_run(l, t, p0, p1, i0, i1, [&](int64_t first, int64_t n) LPSIM_LAMBDA_INLINE {
        if (i1 - i0 == 1) {
          s.amax[0] = max_abs_of<C>(xs, first, n, s.amax[0]);
        } else {
          max_abs_rows<C>(xs, first, n, i1 - i0, s.amax.data());
        }
      });
      s.rounder.set_scales(s.amax.data(), i1 - i0);
    }
    round_group<C>(s, rounding, xs, ys, l, t, p0, p1, i0, i1);
    if (++chunk < tasks.chunks) continue;
    chunk = 0;
    if (++slice < tasks.slices) continue;
    slice = 0;
    ++group;
    cursor.next();
  }
}

template <class C>
LPSIM_INLINE void max_abs_impl(const void* x, const ScaledLayout& l, int64_t g, int64_t p0,
                               int64_t p1, int64_t i0, int64_t i1, uint64_t* amax) {
  using W = typename C::word;
  const auto* xs = static_cast<const typename C::storage*>(x);
  const int64_t width = i1 - i0;
  if (width == 1) {  // one block: a reduction in a register, which vectorises
    W m = static_cast<W>(amax[0]);
    for_each_run(l, group_tile(l, g), p0, p1, i0, i1,
                 [&](int64_t first, int64_t n)
                     LPSIM_LAMBDA_INLINE { m = max_abs_of<C>(xs, first, n, m); });
    amax[0] = m;
    return;
  }
  std::vector<W> m(amax, amax + width);
  for_each_run(l, group_tile(l, g), p0, p1, i0, i1,
               [&](int64_t first, int64_t n)
                   LPSIM_LAMBDA_INLINE { max_abs_rows<C>(xs, first, n, width, m.data()); });
  std::copy(m.begin(), m.end(), amax);
}

}  // namespace

LPSIM_MULTIVERSION
void scaled_quantize(Dtype dtype, Rounding rounding, const void* x, void* y,
                     const ScaledLayout& layout, const ScaledTasks& tasks, int64_t begin,
                     int64_t end, const ScaledSpec& spec, const RandomSpec& random,
                     const BlockScale* scales) {
  with_container(dtype, [&](auto container) LPSIM_LAMBDA_INLINE {
    tasks_impl<decltype(container)>(rounding, x, y, layout, tasks, begin, end, spec, random,
                                    scales);
  });
}

LPSIM_MULTIVERSION
void scaled_max_abs(Dtype dtype, const void* x, const ScaledLayout& layout, int64_t g, int64_t p0,
                    int64_t p1, int64_t i0, int64_t i1, uint64_t* amax) {
  with_container(dtype, [&](auto container) LPSIM_LAMBDA_INLINE {
    max_abs_impl<decltype(container)>(x, layout, g, p0, p1, i0, i1, amax);
  });
}

LPSIM_MULTIVERSION
void scaled_groups_max_abs(Dtype dtype, const void* x, const ScaledLayout& layout, int64_t g0,
                           int64_t g1, uint64_t* amax) {
  const int64_t positions = layout.positions();
  with_container(dtype, [&](auto container) LPSIM_LAMBDA_INLINE {
    for (int64_t g = g0; g < g1; ++g) {
      max_abs_impl<decltype(container)>(x, layout, g, 0, positions, 0, layout.inner,
                                        amax + g * layout.inner);
    }
  });
}

LPSIM_MULTIVERSION
void max_abs_bits(Dtype dtype, const void* x, int64_t begin, int64_t end, uint64_t* amax) {
  with_container(dtype, [&](auto container) LPSIM_LAMBDA_INLINE {
    using C = decltype(container);
    using W = typename C::word;
    const auto* xs = static_cast<const typename C::storage*>(x);
    *amax = max_abs_of<C>(xs, begin, end - begin, static_cast<W>(*amax));
  });
}

void set_tensor_scale(Dtype dtype, ScaledSpec& spec, uint64_t amax) {
  with_container(dtype, [&](auto container) {
    using C = decltype(container);
    lpsim::set_tensor_scale<C>(spec, static_cast<typename C::word>(amax));
  });
}

void block_scales(Dtype dtype, const ScaledSpec& spec, const uint64_t* amax, int64_t count,
                  BlockScale* scales) {
  with_container(dtype, [&](auto container) {
    using C = decltype(container);
    Grid<ScaledArithmetic<C>> scale_grid{};
    if (spec.rule == ScaleRule::amax) make_grid(spec.scale, scale_grid);  // validated by the op
    for (int64_t k = 0; k < count; ++k) {
      scales[k] = block_scale<C>(static_cast<typename C::word>(amax[k]), spec, scale_grid);
    }
  });
}

void block_statistics_bounds(Dtype dtype, const ScaledSpec& spec, const BlockScale* scales,
                             int64_t count, double element_smallest_normal,
                             StatisticsBounds* bounds) {
  with_container(dtype, [&](auto container) {
    using C = decltype(container);
    const ElementGrids<C> grids = element_grids<C>(spec);
    for (int64_t k = 0; k < count; ++k) {
      bounds[k] = block_statistics_bounds<C>(scales[k], spec, grids, element_smallest_normal);
    }
  });
}

}  // namespace lpsim::cpu
