// What every CPU loop file shares: the function multiversioning of the loops' entry points, and
// the random words of lpsim/philox.h generated a group at a time and cached. Plain C++ on raw
// pointers (no torch headers), so that the loop files can be compiled in several instruction-set
// versions; the *_ops.cpp files check the tensors and split the work across threads with
// at::parallel_for, in tasks that start on a group boundary where words are drawn (kGrain).
#pragma once

#include <lpsim/philox.h>

#include <cstdint>

// Each entry point of a loop file is compiled three times by GCC function multi-versioning
// (target_clones): for x86-64-v4 (AVX-512), for AVX2 and for the baseline x86-64, chosen at load
// time by the CPU. The rounding core uses per-element shift counts, which only AVX2 and later can
// vectorise (vpsllvd/vpsrlvd); AVX-512's masks, three-input logic and 64-bit conversions shorten
// the loops further (on a Zen 4 core, 2^16 float32 elements in cache: float16 to nearest 0.80x the
// AVX2 clone's time, e4m3 to nearest 0.79x, toward -inf 0.78x, stochastically 0.90-0.93x). The core
// is integer code, so every version returns the same bits. Everything beneath an entry point must
// be inlined into it (LPSIM_INLINE, LPSIM_LAMBDA_INLINE) to be compiled for the clone's target.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LPSIM_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define LPSIM_MULTIVERSION
#endif

// Loops whose arithmetic reproduces another library's fused multiply-adds (the optimizer steps,
// lpsim/optim_step.h) are cloned for x86-64-v4 and x86-64-v3 (AVX2 with FMA) instead, so that
// std::fma is one instruction; every clone computes the same correctly rounded fma.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LPSIM_MULTIVERSION_FMA \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define LPSIM_MULTIVERSION_FMA
#endif

// The dispatch lambdas must be inlined into the entry points so that they are compiled for each
// clone's target; left out of line they were compiled for the baseline and ran 5x slower.
#define LPSIM_LAMBDA_INLINE __attribute__((always_inline))

namespace lpsim::cpu {

// Elements per parallel task: a multiple of the random-word group, so that tasks do not share a
// group (each task then generates each of its groups once).
constexpr int64_t kGrain = 64 * kGroupSize;

// The random words of one group of kGroupSize elements, in the layout of lpsim/philox.h:
// words[64 w + l] = word w of counter 64 group + l. Uses the fastest generator this CPU runs
// (philox.cpp).
void philox_group(uint64_t group, const PhiloxKey& key, uint32_t* words);

// Name of the generator philox_group uses on this CPU ("avx512vl", "avx2" or "scalar"), for
// benchmarks.
const char* philox_group_isa();

// Whether every generator this CPU runs gives the words of group `group` that philox_group gives
// (the test hook random_words checks the generators the CPU does not choose with it).
bool philox_generators_agree(uint64_t group, const PhiloxKey& key);

// The position-keyed words of one (seed, offset) for any sequence of element indices: the words
// of a group are generated together (all four words of every Philox call are used, which is what
// keeps stochastic rounding near memory speed) and kept while the indices stay in the group.
class WordCache {
 public:
  explicit WordCache(const PhiloxKey& key) : key_(key) {}

  // The kGroupSize words of group g: element g * kGroupSize + j takes group(g)[j].
  LPSIM_INLINE const uint32_t* group(int64_t g) {
    if (g != group_) {
      philox_group(static_cast<uint64_t>(g), key_, words_);
      group_ = g;
    }
    return words_;
  }

  // The word of element `index`.
  LPSIM_INLINE uint32_t operator()(int64_t index) {
    return group(index / kGroupSize)[index % kGroupSize];
  }

 private:
  PhiloxKey key_;
  int64_t group_ = -1;
  alignas(64) uint32_t words_[kGroupSize];
};

// The words of the element indices of one residue modulo kStride (a divisor of kGroupCounters),
// for loops that draw every kStride-th word, as a MAC draws one word per term and rounding
// (lpsim/mac.h: kMacWordsPerTerm apart). Those elements of a group are words 0..3 of its counters
// congruent to the residue, so a group costs kGroupCounters / kStride Philox calls instead of
// kGroupCounters; the words are WordCache's.
template <int kStride>
class StridedWordCache {
  static_assert(kGroupCounters % kStride == 0, "the stride must divide the counters of a group");
  static constexpr int kCounters = kGroupCounters / kStride;

 public:
  explicit StridedWordCache(const PhiloxKey& key) : key_(key) {}

  // The word of element `index` (every index given must have the same residue modulo kStride).
  LPSIM_INLINE uint32_t operator()(int64_t index) {
    const int64_t g = index / kGroupSize;
    const int64_t within = index % kGroupSize;  // word within / 64 of counter within % 64
    const int64_t lane = within % kGroupCounters;
    if (g != group_) {
      const int64_t residue = lane % kStride;
      for (int c = 0; c < kCounters; ++c) {
        const PhiloxWords out = philox_counter_words(
            static_cast<uint64_t>(g * kGroupCounters + residue + kStride * c), key_);
        for (int w = 0; w < 4; ++w) words_[w * kCounters + c] = out.w[w];
      }
      group_ = g;
    }
    return words_[(within / kGroupCounters) * kCounters + lane / kStride];
  }

 private:
  PhiloxKey key_;
  int64_t group_ = -1;
  uint32_t words_[4 * kCounters];
};

}  // namespace lpsim::cpu
