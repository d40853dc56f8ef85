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

#include <type_traits>

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

// The constants of Philox4x32: the round multipliers and the key schedule's Weyl increments.
constexpr uint32_t kPhiloxMul0 = 0xD2511F53u, kPhiloxMul1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxWeyl0 = 0x9E3779B9u, kPhiloxWeyl1 = 0xBB67AE85u;

// A counter's four words. Each word may be a uint32_t or a SIMD pack of uint32 lanes, so that a
// word equal in every lane can stay scalar (philox4x32_10_lanes).
template <class W0, class W1, class W2, class W3>
struct PhiloxCounter {
  W0 c0;
  W1 c1;
  W2 c2;
  W3 c3;
};

template <class W0, class W1, class W2, class W3>
LPSIM_FN PhiloxCounter<W0, W1, W2, W3> philox_counter(W0 c0, W1 c1, W2 c2, W3 c3) {
  return PhiloxCounter<W0, W1, W2, W3>{c0, c1, c2, c3};
}

// a ^ b ^ k, the scalar operands combined first: one vector operation fewer where a is a scalar
// and b a vector.
template <class A, class B>
LPSIM_FN auto xor3(const A& a, const B& b, uint32_t k) {
  if constexpr (std::is_same_v<A, uint32_t>) {
    return b ^ (a ^ k);
  } else {
    return a ^ (b ^ k);
  }
}

// Round `round` (0..9) of Philox4x32-10: the one definition of the round that every generator
// uses. A SIMD lane type V must support V ^ V, V ^ uint32_t, uint32_t ^ V and mulhilo(uint32_t,
// V, V&, V&); the type of each result word follows from its operands.
template <class W0, class W1, class W2, class W3>
LPSIM_FN auto philox_round(const PhiloxCounter<W0, W1, W2, W3>& c, uint32_t k0, uint32_t k1,
                           int round) {
  k0 += static_cast<uint32_t>(round) * kPhiloxWeyl0;
  k1 += static_cast<uint32_t>(round) * kPhiloxWeyl1;
  W0 hi0, lo0;
  W2 hi1, lo1;
  mulhilo(kPhiloxMul0, c.c0, hi0, lo0);
  mulhilo(kPhiloxMul1, c.c2, hi1, lo1);
  return philox_counter(xor3(hi1, c.c1, k0), lo1, xor3(hi0, c.c3, k1), lo0);
}

// Rounds kFirst..9 of Philox4x32-10 on the counter (c0, c1, c2, c3), in place, with the key (k0,
// k1). V is uint32_t or a SIMD lane type (see philox_round).
template <int kFirst, class V>
LPSIM_FN void philox_rounds_from(V& c0, V& c1, V& c2, V& c3, uint32_t k0, uint32_t k1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = kFirst; round < 10; ++round) {
    const PhiloxCounter<V, V, V, V> next =
        philox_round(philox_counter(c0, c1, c2, c3), k0, k1, round);
    c0 = next.c0;
    c1 = next.c1;
    c2 = next.c2;
    c3 = next.c3;
  }
}

// Ten Philox4x32 rounds on the counter (c0, c1, c2, c3), in place, with the key (k0, k1).
template <class V>
LPSIM_FN void philox4x32_10(V& c0, V& c1, V& c2, V& c3, uint32_t k0, uint32_t k1) {
  philox_rounds_from<0>(c0, c1, c2, c3, k0, k1);
}

// Philox4x32-10 of counters that differ only in their low word c0 (the lanes of V), with the same
// high words c1, c2, c3 (uint32_t) in every lane, as the counters of one group do; the four words
// of each lane are returned in out0..out3. The same words as philox4x32_10, with fewer vector
// operations: round 0 multiplies the lane-constant c2 and round 1 the lane-constant word it leaves
// in c0, so 2 of the 20 multiplications are scalar.
template <class V>
LPSIM_FN void philox4x32_10_lanes(const V& c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                  uint32_t k1, V& out0, V& out1, V& out2, V& out3) {
  const auto r0 = philox_round(philox_counter(c0, c1, c2, c3), k0, k1, 0);  // (u32, u32, V, V)
  const auto r1 = philox_round(r0, k0, k1, 1);                              // (V, V, V, u32)
  const PhiloxCounter<V, V, V, V> r2 = philox_round(r1, k0, k1, 2);
  out0 = r2.c0;
  out1 = r2.c1;
  out2 = r2.c2;
  out3 = r2.c3;
  philox_rounds_from<3>(out0, out1, out2, out3, k0, k1);
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
