// The arithmetic of a simulated multiply-accumulate (lpsim/mac.py defines every variant), the same
// on the host and the device: MacSum adds one result's terms (its products, in increasing k) as
// the MAC's order prescribes, every rounding exact and then rounded once (exact_sum.h). Values are
// float64 words: every format fits float64, and float64 holds the exact product of two values of
// at most 25 significant bits.
//
// Every variant is a stream: the terms arrive one at a time and MacSum keeps O(log K) state, so a
// loop needs no buffer of a result's products. The pairwise tree, whose left part is always the
// largest power of two below the count, is built as a binary counter: term k joins the stack as a
// block of one, equal blocks on top merge, and the blocks left at the end merge from the right.
//
// A tensor core (tensor_core.h) buffers one group of products at a time: its alignment needs the
// group's largest exponent before any product is truncated.
#pragma once

#include <cstdint>

#include "config.h"
#include "container.h"
#include "exact_sum.h"
#include "grid_spec.h"
#include "round.h"
#include "tensor_core.h"

namespace lpsim {

enum class MacOrder : int32_t { kSequential = 0, kChunked = 1, kPairwise = 2 };

// Random words per term and result: rounding j of term k of result r draws word
// kMacWordsPerTerm * (r K + k) + j.
constexpr int64_t kMacWordsPerTerm = 8;
enum MacWord : int64_t {
  kProductWord = 0,    // the product's rounding
  kAddWord = 1,        // the addition that brings term k in (pairwise: the node split at k;
                       // tensor core: the normalisation of the group ending at k)
  kChunkWord = 2,      // the addition of the chunk ending at k into the accumulator
  kKahanTermWord = 3,  // Kahan: y = t_k - c
  kKahanDiffWord = 4,  // Kahan: u - s
  kKahanCarryWord = 5  // Kahan: c = (u - s) - y
};

// A MAC's order and its grids (Grid<Float64Container>, made by the caller).
struct MacShape {
  MacOrder order;
  int64_t chunk;                 // terms per chunk (kChunked)
  bool compensated;              // Kahan (kSequential)
  TensorCoreSpec tensor_core{};  // group 0: no tensor core; else kSequential or kChunked
};

// The deepest pairwise stack: one block per bit of the term count.
constexpr int kMacStackDepth = 64;

// One result's running sum. `product` is the grid products are rounded onto (nullptr: exact
// products), `acc` the accumulator's and `inner` the chunks' (kChunked). `words` maps a word index
// to its random word (unused by the deterministic rules); `first_word` is kMacWordsPerTerm * r K.
template <Rounding R, class Words>
class MacSum {
 public:
  using F64 = Float64Container;

  LPSIM_FN MacSum(const MacShape& shape, const Grid<F64>* product, const Grid<F64>& acc,
                  const Grid<F64>& inner, uint32_t mask, Words& words, int64_t first_word)
      : shape_(shape),
        product_(product),
        acc_(acc),
        inner_(inner),
        mask_(mask),
        words_(words),
        first_word_(first_word) {}

  // Adds term k, the product of the operands ua and ub (words of container X), k = 0, 1, ... in
  // turn.
  template <class X>
  LPSIM_FN void add_operands(typename X::word ua, typename X::word ub, int64_t k) {
    const uint64_t product = exact_product<X>(ua, ub);
    const TensorCoreSpec& core = shape_.tensor_core;
    if (core.group == 0) {
      add(product, k);
      return;
    }
    group_.add(product, convert_exact<F64, X>(ua), convert_exact<F64, X>(ub), core.operand_emin);
    group_open_ = true;
    last_ = k;
    if ((k + 1) % core.group == 0) close_group(k);
  }

  // Adds the exact product of term k (float64 bits), k = 0, 1, ... in turn (no tensor core).
  LPSIM_FN void add(uint64_t exact_product, int64_t k) {
    const uint64_t term =
        product_ != nullptr ? rounded(exact_product, *product_, k, kProductWord) : exact_product;
    if (shape_.order == MacOrder::kPairwise) {
      push(term, k);
    } else if (shape_.order == MacOrder::kChunked) {
      const int64_t position = k % shape_.chunk;
      chunk_sum_ = position == 0 ? rounded(term, inner_, k, kAddWord)
                                 : added(chunk_sum_, term, inner_, k, kAddWord);
      if (position == shape_.chunk - 1) close_chunk(k);
      last_ = k;
    } else if (k == 0) {
      sum_ = rounded(term, acc_, k, kAddWord);
    } else if (shape_.compensated) {
      const uint64_t y = added(term, negated(carry_), acc_, k, kKahanTermWord);
      const uint64_t u = added(sum_, y, acc_, k, kAddWord);
      const uint64_t difference = added(u, negated(sum_), acc_, k, kKahanDiffWord);
      carry_ = added(difference, negated(y), acc_, k, kKahanCarryWord);
      sum_ = u;
    } else {
      sum_ = added(sum_, term, acc_, k, kAddWord);
    }
  }

  // The result after `count` terms (+0 for none).
  LPSIM_FN uint64_t finish(int64_t count) {
    if (count == 0) return 0;
    if (shape_.tensor_core.group != 0 && group_open_) close_group(last_);
    if (shape_.order == MacOrder::kChunked) {
      if ((last_ + 1) % shape_.chunk != 0) close_chunk(last_);
    } else if (shape_.order == MacOrder::kPairwise) {
      if (count == 1) return rounded(stack_[0], acc_, 0, kAddWord);
      while (depth_ > 1) merge();
      return stack_[0];
    }
    return sum_;
  }

 private:
  LPSIM_FN uint32_t word(int64_t k, int64_t j) {
    if constexpr (is_stochastic(R)) {
      return words_(first_word_ + kMacWordsPerTerm * k + j);
    } else {
      return 0;
    }
  }
  LPSIM_FN uint64_t rounded(uint64_t v, const Grid<F64>& g, int64_t k, int64_t j) {
    return round_to_grid<R, F64>(v, g, word(k, j), mask_);
  }
  LPSIM_FN uint64_t added(uint64_t a, uint64_t b, const Grid<F64>& g, int64_t k, int64_t j) {
    return round_sum_to_grid<R, F64>(a, b, g, word(k, j), mask_);
  }
  LPSIM_FN static uint64_t negated(uint64_t v) { return v ^ F64::sign_mask; }

  // Adds the chunk that ends at term k into the accumulator.
  LPSIM_FN void close_chunk(int64_t k) {
    sum_ = started_ ? added(sum_, chunk_sum_, acc_, k, kChunkWord)
                    : rounded(chunk_sum_, acc_, k, kChunkWord);
    started_ = true;
    chunk_sum_ = 0;  // a tensor core's next chunk starts from c = +0
  }

  // Tensor core: the group that ends at term k becomes the next value of its chain (the chunk's
  // sum, kChunked, or the running sum), and a chunk that ends there is added into the accumulator.
  LPSIM_FN void close_group(int64_t k) {
    const TensorCoreSpec& core = shape_.tensor_core;
    const bool chunked = shape_.order == MacOrder::kChunked;
    uint64_t& chain = chunked ? chunk_sum_ : sum_;
    const uint32_t random =
        is_stochastic(core.normalise) ? words_(first_word_ + kMacWordsPerTerm * k + kAddWord) : 0;
    chain = tensor_core_step(core, group_, chain, chunked ? inner_ : acc_, random, mask_);
    group_.clear();
    group_open_ = false;
    if (chunked && (k + 1) % shape_.chunk == 0) close_chunk(k);
  }

  // Pairwise: term k joins as a block of one; equal blocks on top merge.
  LPSIM_FN void push(uint64_t term, int64_t k) {
    stack_[depth_] = term;
    first_[depth_] = k;
    size_[depth_] = 1;
    ++depth_;
    while (depth_ > 1 && size_[depth_ - 2] == size_[depth_ - 1]) merge();
  }
  // The two top blocks become one: the node split at the right block's first term.
  LPSIM_FN void merge() {
    const int top = depth_ - 1;
    stack_[top - 1] = added(stack_[top - 1], stack_[top], acc_, first_[top], kAddWord);
    size_[top - 1] += size_[top];
    --depth_;
  }

  const MacShape& shape_;
  const Grid<F64>* product_;
  const Grid<F64>& acc_;
  const Grid<F64>& inner_;
  uint32_t mask_;
  Words& words_;
  int64_t first_word_;
  uint64_t sum_ = 0;
  uint64_t carry_ = 0;  // Kahan's compensation (+0 at the start)
  uint64_t chunk_sum_ = 0;
  int64_t last_ = 0;
  bool started_ = false;
  uint64_t stack_[kMacStackDepth] = {};
  int64_t first_[kMacStackDepth] = {};
  int64_t size_[kMacStackDepth] = {};
  int depth_ = 0;
  TensorCoreGroup group_;
  bool group_open_ = false;
};

}  // namespace lpsim
