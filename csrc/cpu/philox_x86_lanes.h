// Philox4x32-10 for 32 counters at once on x86 vectors: the generator of lpsim/philox.h
// instantiated on a lane type of four independent 8-lane (256-bit) vectors. Included, after a
// target pragma, by philox_avx2.cpp (AVX2) and philox_avx512.cpp (AVX2 with AVX-512VL), each of
// which defines LPSIM_PHILOX_AVX512VL to 0 or 1 first: the one lane type, compiled for each target.
//
// Measured on a 2-core Zen 3, per 32-bit word: 2.0-2.4 ns for the scalar loop left to gcc's
// auto-vectoriser (it does not find the widening multiply), 0.91 ns with one 8-lane vector, 0.60
// ns with four (their multiplies overlap). The lane-constant words of the first rounds kept scalar
// (philox4x32_10_lanes) and the low halves of the products taken by vpmulld: 0.78x the time of the
// loop before them, the median ratio of 200 alternated runs of a stand-alone benchmark (0.51-0.53
// against 0.69-0.70 ns at best).
//
// With AVX-512VL (Zen 4, 2 cores, a stand-alone benchmark of 3000 alternated runs of 2^16 words,
// the 10th percentiles): the three-way XOR of each round's outputs in one vpternlogd and the high
// halves merged by one vpermt2d instead of a shift and a blend: 0.345 against 0.42-0.43 ns per
// word (0.80-0.81x). 512-bit vectors were slower (two vectors of 16 lanes 0.37 ns, four 0.45 ns):
// Zen 4 runs them as two 256-bit halves, and the lanes' registers spill.
#pragma once

#include <immintrin.h>
#include <lpsim/philox.h>

namespace lpsim::cpu {
namespace {

constexpr int kVectors = 4;  // independent 8-lane vectors per lane type
constexpr int kLanes = 8 * kVectors;

struct U32x32 {
  __m256i v[kVectors];
};

inline U32x32 broadcast(uint32_t x) {
  U32x32 r;
  for (int i = 0; i < kVectors; ++i) r.v[i] = _mm256_set1_epi32(static_cast<int>(x));
  return r;
}

inline U32x32 operator^(const U32x32& a, const U32x32& b) {
  U32x32 r;
  for (int i = 0; i < kVectors; ++i) r.v[i] = _mm256_xor_si256(a.v[i], b.v[i]);
  return r;
}

inline U32x32 operator^(const U32x32& a, uint32_t b) { return a ^ broadcast(b); }

inline U32x32 operator^(uint32_t a, const U32x32& b) { return broadcast(a) ^ b; }

#if LPSIM_PHILOX_AVX512VL
// a ^ b ^ k in one operation (vpternlogd, truth table 0x96); found by argument-dependent lookup
// and preferred to philox.h's template for two vector operands.
inline U32x32 xor3(const U32x32& a, const U32x32& b, uint32_t k) {
  const __m256i kv = _mm256_set1_epi32(static_cast<int>(k));
  U32x32 r;
  for (int i = 0; i < kVectors; ++i) r.v[i] = _mm256_ternarylogic_epi32(a.v[i], b.v[i], kv, 0x96);
  return r;
}
#endif

// The high halves: vpmuludq multiplies the even lanes; the odd lanes are shifted down, multiplied,
// and the high halves of both products brought back into lane order (a shift and a blend; with
// AVX-512VL one two-source permute). The low halves: vpmulld.
inline void mulhilo(uint32_t m, const U32x32& a, U32x32& hi, U32x32& lo) {
  const __m256i mv = _mm256_set1_epi32(static_cast<int>(m));
#if LPSIM_PHILOX_AVX512VL
  const __m256i high_halves = _mm256_setr_epi32(1, 9, 3, 11, 5, 13, 7, 15);
#endif
  for (int i = 0; i < kVectors; ++i) {
    const __m256i even = _mm256_mul_epu32(a.v[i], mv);
    const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a.v[i], 32), mv);
#if LPSIM_PHILOX_AVX512VL
    hi.v[i] = _mm256_permutex2var_epi32(even, high_halves, odd);
#else
    hi.v[i] = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
#endif
    lo.v[i] = _mm256_mullo_epi32(a.v[i], mv);
  }
}

// The words of one group (see loops.h: philox_group).
inline void philox_group_lanes(uint64_t group, const PhiloxKey& key, uint32_t* words) {
  static_assert(kGroupCounters % kLanes == 0, "a group is a whole number of lane batches");
  for (int l = 0; l < kGroupCounters; l += kLanes) {
    // 64 g + l + lane never carries into the high word: the group's 64 counters share it.
    const uint64_t first = group * kGroupCounters + static_cast<uint64_t>(l);
    U32x32 c0 = broadcast(static_cast<uint32_t>(first));
    for (int i = 0; i < kVectors; ++i) {
      c0.v[i] = _mm256_add_epi32(c0.v[i], _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      c0.v[i] = _mm256_add_epi32(c0.v[i], _mm256_set1_epi32(8 * i));
    }
    U32x32 w0, w1, w2, w3;
    philox4x32_10_lanes(c0, static_cast<uint32_t>(first >> 32), key.c2, key.c3, key.k0, key.k1, w0,
                        w1, w2, w3);
    const U32x32* out[4] = {&w0, &w1, &w2, &w3};
    for (int w = 0; w < 4; ++w) {
      for (int i = 0; i < kVectors; ++i) {
        __m256i* dst = reinterpret_cast<__m256i*>(words + w * kGroupCounters + l + 8 * i);
        _mm256_storeu_si256(dst, out[w]->v[i]);
      }
    }
  }
}

}  // namespace
}  // namespace lpsim::cpu
