// Bit layout of the IEEE binary formats a tensor can be stored in (its "container").
#pragma once

#include "config.h"

namespace lpsim {

// Storage: how one element sits in memory. Word: the unsigned integer the rounding core computes
// on (at least 32 bits, so a 16-bit container's bits and a 32-bit random word fit side by side).
template <class Storage, class Word, int ExpBits, int ManBits>
struct Container {
  using storage = Storage;
  using word = Word;
  static constexpr int exp_bits = ExpBits;
  static constexpr int man_bits = ManBits;  // stored fraction bits; precision is man_bits + 1
  static constexpr int bias = (1 << (ExpBits - 1)) - 1;
  static constexpr int word_bits = 8 * static_cast<int>(sizeof(Word));
  static constexpr Word sign_mask = Word(1) << (ExpBits + ManBits);
  static constexpr Word abs_mask = sign_mask - 1;
  static constexpr Word man_mask = (Word(1) << ManBits) - 1;
  static constexpr Word inf_bits = abs_mask & ~man_mask;
  static constexpr Word quiet_nan = inf_bits | (Word(1) << (ManBits - 1));
};

using Float32Container = Container<uint32_t, uint32_t, 8, 23>;
using Float64Container = Container<uint64_t, uint64_t, 11, 52>;
using BFloat16Container = Container<uint16_t, uint32_t, 8, 7>;
using Float16Container = Container<uint16_t, uint32_t, 5, 10>;

}  // namespace lpsim
