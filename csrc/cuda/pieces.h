// Index arithmetic of the CUDA kernels, host and device: which shared-exponent block ("piece") an
// element belongs to. Plain integer code, usable and testable on the host.
#pragma once

#include <lpsim/config.h>

namespace lpsim::gpu {

// Division of 64-bit indices by a divisor fixed before the launch. A 64-bit division is a long
// subroutine on the GPU and the block kernels divide every element's index; for dividends and
// divisors below 2^32 (nearly every tensor) a multiply-high and a shift replace it.
//
// Method (Granlund and Montgomery, "Division by invariant integers using multiplication", 1994):
// with s = ceil(log2 d) and magic = floor(2^32 (2^s - d) / d) + 1 < 2^32, the multiplier
// M = 2^32 + magic = floor(2^(32+s) / d) + 1 exceeds 2^(32+s) / d by at most 1, so for n < 2^32
// n M / 2^(32+s) exceeds n / d by less than 2^-s <= 1/d, too little to reach the next integer:
// floor(n M / 2^(32+s)) = floor(n / d), and n M / 2^32 = mulhi(n, magic) + n.
struct Divider {
  uint64_t divisor;
  uint32_t magic;
  uint32_t shift;
  bool fast;  // divisor < 2^32: the multiply applies to dividends below 2^32

  static Divider of(uint64_t d) {  // d >= 1
    Divider r{d, 0, 0, d <= 0xFFFFFFFFull};
    if (r.fast) {
      while ((uint64_t(1) << r.shift) < d) ++r.shift;
      // 2^s - d < d < 2^32, so the product below stays under 2^64.
      r.magic = static_cast<uint32_t>((((uint64_t(1) << r.shift) - d) << 32) / d + 1);
    }
    return r;
  }

  LPSIM_FN uint64_t div(uint64_t n) const {
    if (fast && n <= 0xFFFFFFFFull) {
      const uint32_t m = static_cast<uint32_t>(n);
#if defined(__CUDA_ARCH__)
      const uint32_t hi = __umulhi(m, magic);
#else
      const uint32_t hi = static_cast<uint32_t>((static_cast<uint64_t>(m) * magic) >> 32);
#endif
      return (static_cast<uint64_t>(hi) + n) >> shift;
    }
    return n / divisor;
  }

  LPSIM_FN uint64_t mod(uint64_t n) const { return n - div(n) * divisor; }
};

// The flattened tensor as rows of row_len elements, each row cut into pieces of piece_len elements
// (the last piece of a row may be shorter). Pieces are numbered in row-major order and piece p
// takes the shared exponent number p % classes. The three block layouts:
//   whole tensor        one row, one piece, one class;
//   one exponent per    rows of `inner` elements (the product of the sizes after dim), one piece
//   index along dim     per row, classes = the size of dim;
//   block_size          rows of the last dimension, pieces of block_size, one class per piece.
struct Pieces {
  Divider row_len;
  Divider piece_len;
  Divider classes;
  uint64_t per_row;  // pieces per row, ceil(row_len / piece_len)

  LPSIM_FN uint64_t piece_of(uint64_t i) const {
    const uint64_t row = row_len.div(i);
    return row * per_row + piece_len.div(i - row * row_len.divisor);
  }
  LPSIM_FN uint64_t class_of(uint64_t i) const { return classes.mod(piece_of(i)); }

  // Elements [start(p), stop(p)) of piece p.
  LPSIM_FN uint64_t start(uint64_t p) const {
    const uint64_t row = p / per_row;
    return row * row_len.divisor + (p - row * per_row) * piece_len.divisor;
  }
  LPSIM_FN uint64_t stop(uint64_t p) const {
    const uint64_t row_end = (p / per_row + 1) * row_len.divisor;
    const uint64_t end = start(p) + piece_len.divisor;
    return end < row_end ? end : row_end;
  }

  // One class per index along a dimension: rows of `inner` elements, row r in class r % classes.
  static Pieces along(uint64_t inner, uint64_t classes) {
    return Pieces{Divider::of(inner), Divider::of(inner), Divider::of(classes), 1};
  }

  // Blocks of block_size consecutive elements along rows of row_len; n elements in all. A block
  // longer than the row is the row itself, so piece_len is clamped to row_len: the pieces are the
  // same and no loop runs over the empty part of a piece.
  static Pieces blocks(uint64_t n, uint64_t row_len, uint64_t block_size) {
    const uint64_t len = block_size < row_len ? block_size : row_len;
    const uint64_t per_row = (row_len + len - 1) / len;
    return Pieces{Divider::of(row_len), Divider::of(len), Divider::of(n / row_len * per_row),
                  per_row};
  }
};

}  // namespace lpsim::gpu
