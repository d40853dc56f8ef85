// The random words of stochastic rounding: Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel
// random numbers: as easy as 1, 2, 3", SC 2011), a counter-based generator, so every element's
// word is a pure function of (seed, offset, element index): nothing is stored, the result does not
// depend on the thread count or on the device, and CPU and CUDA draw the same words.
//
// How elements map to words. The element stream (logical row-major index i) is cut into groups of
// kGroupSize = 256 elements. Group g uses the 64 counters 64 g + l, l = 0..63; element
// 256 g + 64 w + l takes output word w (0..3) of counter 64 g + l. The 128-bit counter is
// (counter lo, counter hi, offset lo, offset hi) and the 64-bit key is (seed lo, seed hi), so
// different offsets under one seed are disjoint streams. Word-major order inside a group lets a
// SIMD loop generate 8 (or 16) counters at once and store each output word contiguously.
#pragma once

#include "config.h"

namespace lpsim {

constexpr int kGroupSize = 256;     // elements per group
constexpr int kGroupCounters = 64;  // Philox calls per group (4 words each)

struct PhiloxKey {
  uint32_t k0, k1;  // seed
  uint32_t c2, c3;  // offset: the high half of every counter
};

LPSIM_FN PhiloxKey make_philox_key(uint64_t seed, uint64_t offset) {
  return PhiloxKey{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                   static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32)};
}

// 32 x 32 -> 64-bit product split into halves. SIMD lane types provide their own overload.
LPSIM_FN void mulhilo(uint32_t m, uint32_t a, uint32_t& hi, uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  hi = __umulhi(m, a);
  lo = m * a;
#else
  const uint64_t p = static_cast<uint64_t>(m) * a;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
#endif
}

// Ten Philox4x32 rounds on the counter (c0, c1, c2, c3), in place. V is uint32_t or a SIMD pack of
// uint32 lanes that supports ^ with V and with uint32_t, and mulhilo(uint32_t, V, V&, V&): this
// one definition serves the scalar, vectorised CPU and CUDA generators.
template <class V>
LPSIM_FN void philox4x32_10(V& c0, V& c1, V& c2, V& c3, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    V hi0, lo0, hi1, lo1;
    mulhilo(kMul0, c0, hi0, lo0);
    mulhilo(kMul1, c2, hi1, lo1);
    const V n0 = hi1 ^ c1 ^ k0;
    const V n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
}

// The four words of one counter.
struct PhiloxWords {
  uint32_t w[4];
};

LPSIM_FN PhiloxWords philox_counter_words(uint64_t counter, const PhiloxKey& key) {
  uint32_t c0 = static_cast<uint32_t>(counter), c1 = static_cast<uint32_t>(counter >> 32);
  uint32_t c2 = key.c2, c3 = key.c3;
  philox4x32_10(c0, c1, c2, c3, key.k0, key.k1);
  return PhiloxWords{{c0, c1, c2, c3}};
}

// Counter and word that element `index` uses (see the mapping above).
LPSIM_FN uint64_t philox_counter_of(uint64_t index) {
  return (index / kGroupSize) * kGroupCounters + index % kGroupCounters;
}
LPSIM_FN int philox_word_of(uint64_t index) {
  return static_cast<int>((index % kGroupSize) / kGroupCounters);
}

// The inverse, for generators that run one counter at a time (the CUDA kernels: one thread per
// counter, using all four words): the element that takes word w of counter c.
LPSIM_FN uint64_t philox_element_of(uint64_t counter, int w) {
  return counter / kGroupCounters * kGroupSize + counter % kGroupCounters +
         static_cast<uint64_t>(w) * kGroupCounters;
}

// How many counters cover elements [0, n): those of every group the elements touch.
LPSIM_FN uint64_t philox_counters_for(uint64_t n) {
  return (n + kGroupSize - 1) / kGroupSize * kGroupCounters;
}

// The random word of one element: the definition every generator must reproduce.
LPSIM_FN uint32_t random_word(uint64_t index, const PhiloxKey& key) {
  return philox_counter_words(philox_counter_of(index), key).w[philox_word_of(index)];
}

// Value-keyed words: a word that depends on the operands' values instead of the element's
// position, so that the same operands round the same way whatever the layout, the order of the
// elements or the thread count. The counter is the two operands' float64 bits (lo, hi, lo, hi),
// the key is derived once per call from (seed, offset) by one Philox call on the counter
// (offset lo, offset hi, kValueTag0, kValueTag1) under the seed, whose first two words are the key.
constexpr uint32_t kValueTag0 = 0x756C6176u;  // "valu"
constexpr uint32_t kValueTag1 = 0x79656B65u;  // "ekey"

struct ValueKey {
  uint32_t k0, k1;
};

LPSIM_FN ValueKey make_value_key(uint64_t seed, uint64_t offset) {
  uint32_t c0 = static_cast<uint32_t>(offset), c1 = static_cast<uint32_t>(offset >> 32);
  uint32_t c2 = kValueTag0, c3 = kValueTag1;
  philox4x32_10(c0, c1, c2, c3, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return ValueKey{c0, c1};
}

// The word for operands whose float64 bits are a and b: the first output word of Philox4x32-10.
LPSIM_FN uint32_t value_word(uint64_t a, uint64_t b, const ValueKey& key) {
  uint32_t c0 = static_cast<uint32_t>(a), c1 = static_cast<uint32_t>(a >> 32);
  uint32_t c2 = static_cast<uint32_t>(b), c3 = static_cast<uint32_t>(b >> 32);
  philox4x32_10(c0, c1, c2, c3, key.k0, key.k1);
  return c0;
}

}  // namespace lpsim
